"""Triton page gather / scatter for many layers in one launch. Contract: kernels/page_copy/naive.py.

The per-layer caches are passed as a table of base addresses (the Triton grouped-GEMM tutorial's
pointer-array idiom), so packing all attention layers of a request is one launch, not one per layer.
Each program copies a [BLOCK_T tokens, BLOCK_E entry elements] tile of one layer; pages are looked up per
token, so any start / length (page-unaligned) works.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.triton_utils import check_device, next_pow2


@triton.jit
def _page_copy_kernel(
    PTRS,  # [L] int64 base addresses of the caches
    CACHE0,  # the first cache: gives the element type
    BUF,  # [L, num_tokens, E] packed buffer
    BT,  # [pages] block table
    start,
    num_tokens,
    E,
    stride_buf_l,
    PAGE_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    TO_PAGES: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_e = tl.program_id(1)
    i_l = tl.program_id(2).to(tl.int64)
    p_cache = tl.load(PTRS + i_l).to(tl.pointer_type(CACHE0.dtype.element_ty))
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = o_t < num_tokens
    o_e = (i_e * BLOCK_E + tl.arange(0, BLOCK_E)).to(tl.int64)
    m_e = o_e < E
    tok = start + o_t
    page = tl.load(BT + tok // PAGE_SIZE, mask=m_t, other=0).to(tl.int64)
    row = page * PAGE_SIZE + (tok % PAGE_SIZE)
    p_c = p_cache + row[:, None] * E + o_e[None, :]
    p_b = BUF + i_l * stride_buf_l + o_t[:, None].to(tl.int64) * E + o_e[None, :]
    m = m_t[:, None] & m_e[None, :]
    if TO_PAGES:
        tl.store(p_c, tl.load(p_b, mask=m).to(CACHE0.dtype.element_ty), mask=m)
    else:
        tl.store(p_b, tl.load(p_c, mask=m).to(BUF.dtype.element_ty), mask=m)


def _launch(caches: Sequence[torch.Tensor], block_table: torch.Tensor, start: int, buf: torch.Tensor, to_pages: bool):
    c0 = caches[0]
    for c in caches:
        if c.shape != c0.shape or c.dtype != c0.dtype or c.device != c0.device:
            raise ValueError("all caches must share shape, dtype and device")
        if not c.is_contiguous():
            raise ValueError("caches must be contiguous")
    page_size = c0.shape[1]
    num_tokens = buf.shape[1]
    n_pages_needed = -(-(start + num_tokens) // page_size)
    if start < 0 or block_table.shape[0] < n_pages_needed:
        have = block_table.shape[0]
        raise ValueError(f"tokens [{start}, {start + num_tokens}) need {n_pages_needed} pages, block_table has {have}")
    if num_tokens == 0:
        return
    e = c0[0, 0].numel()
    ptrs = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64).to(c0.device, non_blocking=True)
    bt = block_table.to(device=c0.device, dtype=torch.int32)
    block_e = min(next_pow2(e), 1024)
    block_t = max(1, min(next_pow2(num_tokens), 4096 // block_e))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(e, block_e), len(caches))
    _page_copy_kernel[grid](
        ptrs,
        c0,
        buf,
        bt,
        start,
        num_tokens,
        e,
        buf.stride(0),
        PAGE_SIZE=page_size,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        TO_PAGES=to_pages,
        num_warps=4,
    )


def pack_pages(
    caches: Sequence[torch.Tensor],
    block_table: torch.Tensor,
    start: int,
    num_tokens: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather tokens [start, start + num_tokens) of a request from every cache into one buffer.

    Args:
        caches: L caches [num_pages, page_size, *entry] of one shape / dtype (e.g. ``cache.kv[layer]`` for
            the layers to send), contiguous.
        block_table: the request's page ids [pages] (int, any device).
        start, num_tokens: token range (need not be page aligned).
        out: optional [L, num_tokens, *entry] buffer (e.g. pinned / registered memory on the cache's device).
    Returns: [L, num_tokens, *entry] in the caches' dtype, token order.

    Example::

        buf = pack_pages([cache.kv[i] for i in cfg.attention_layers], table, 0, ctx_len)
    """
    if not caches:
        raise ValueError("pack_pages needs at least one cache")
    c0 = caches[0]
    shape = (len(caches), num_tokens, *c0.shape[2:])
    if out is None:
        out = torch.empty(shape, dtype=c0.dtype, device=c0.device)
    elif tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {shape}, got {tuple(out.shape)}")
    check_device("pack_pages", c0, out)
    _launch(caches, block_table, start, out, to_pages=False)
    return out


def unpack_pages(caches: Sequence[torch.Tensor], block_table: torch.Tensor, start: int, packed: torch.Tensor) -> None:
    """Scatter packed [L, num_tokens, *entry] into tokens [start, start + num_tokens) of every cache (in place)."""
    if not caches:
        raise ValueError("unpack_pages needs at least one cache")
    c0 = caches[0]
    if packed.shape[0] != len(caches) or tuple(packed.shape[2:]) != tuple(c0.shape[2:]):
        raise ValueError(f"packed {tuple(packed.shape)} does not match {len(caches)} caches of {tuple(c0.shape)}")
    check_device("unpack_pages", c0, packed)
    _launch(caches, block_table, start, packed.contiguous(), to_pages=True)


__all__ = ["pack_pages", "unpack_pages"]
