"""MLA's cache write in one launch: ``RMSNorm(c_kv) | k_pe`` from kv_a_proj's output straight into the latent
pages. Contract: ``kernels.paged_attention.naive.write_mla_latent``.

The model's form is a norm over the c_kv columns (a contiguous copy first: the fused norms read whole rows),
a concatenation with k_pe, then a scatter into the pages: four launches an MLA layer in every step, and a
decode step is its launches (~210 of them, a few microseconds each: docs/PERFORMANCE.md). Here one program
normalises one token's row, read in place from the strided column view, and stores both parts at its slot;
rows with slot -1 (prefix-cached) are skipped on the device, with no host-side row selection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_kwargs
from kernels.triton_utils import check_device, next_pow2


@triton.jit
def _latent_write_kernel(
    KV_A,
    W,
    SLOTS,
    CACHE,
    eps,
    stride_row,
    R: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_ROPE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    i_t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + i_t).to(tl.int64)
    if slot < 0:
        return
    o_r = tl.arange(0, BLOCK_R)
    m_r = o_r < R
    b_x = tl.load(KV_A + i_t * stride_row + o_r, mask=m_r, other=0.0).to(tl.float32)
    b_rstd = 1 / tl.sqrt(tl.sum(b_x * b_x, axis=0) / R + eps)  # fla's layer_norm_fwd: the same ops
    b_w = tl.load(W + o_r, mask=m_r, other=0.0).to(tl.float32)
    p_out = CACHE + slot * (R + ROPE)
    tl.store(p_out + o_r, (b_x * b_rstd * b_w).to(CACHE.dtype.element_ty), mask=m_r)
    o_p = tl.arange(0, BLOCK_ROPE)
    m_p = o_p < ROPE
    b_pe = tl.load(KV_A + i_t * stride_row + R + o_p, mask=m_p, other=0.0)
    tl.store(p_out + R + o_p, b_pe.to(CACHE.dtype.element_ty), mask=m_p)


def write_mla_latent_triton(
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_a: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    kv_lora_rank: int,
) -> None:
    """``naive.write_mla_latent`` in one launch. cache [pages, page_size, R + rope] contiguous; slot_mapping
    [T] int (flat rows, -1 skipped); kv_a [T, R + rope] with a unit last stride (a column view of a wider
    projection output is read in place); norm_weight [R]."""
    check_device("write_mla_latent", cache, slot_mapping, kv_a, norm_weight)
    t, width = kv_a.shape
    rope = width - kv_lora_rank
    if cache.ndim != 3 or cache.shape[-1] != width or not cache.is_contiguous():
        raise ValueError(f"cache must be a contiguous [pages, page_size, {width}], got {tuple(cache.shape)}")
    if kv_a.stride(1) != 1 or rope < 0 or norm_weight.shape != (kv_lora_rank,):
        raise ValueError(
            f"kv_a [T, {kv_lora_rank} + rope] with a unit last stride and norm_weight [{kv_lora_rank}] expected, "
            f"got {tuple(kv_a.shape)} (strides {kv_a.stride()}) and {tuple(norm_weight.shape)}"
        )
    if slot_mapping.shape != (t,):
        raise ValueError(f"slot_mapping must be [{t}], got {tuple(slot_mapping.shape)}")
    if t == 0:
        return
    _latent_write_kernel[(t,)](
        kv_a,
        norm_weight,
        slot_mapping,
        cache,
        eps,
        kv_a.stride(0),
        R=kv_lora_rank,
        ROPE=rope,
        BLOCK_R=next_pow2(kv_lora_rank),
        BLOCK_ROPE=next_pow2(max(rope, 1)),
        num_warps=4,
        **pdl_kwargs(cache, "attention.latent_write"),
    )


__all__ = ["write_mla_latent_triton"]
