"""The MoE combine in one Triton launch: each token's k expert outputs, weighted and summed. Contract:
``grouped.moe_combine`` (torch: a gather, a multiply, a sum and a cast).

The grouped GEMMs leave the expert outputs in expert-sorted rows. Un-sorting them (a scatter of T*k rows),
weighting and summing took four kernels and wrote / re-read the whole [T*k, H] block; here one program per
(token, column block) gathers the token's k rows straight from the sorted block and sums them in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe.grouped import moe_combine
from kernels.pdl import pdl_enter, pdl_kwargs
from kernels.triton_utils import check_device, is_interpreting, next_pow2


@triton.jit
def weighted_expert_sum(
    Y, ROWS, W, t, cols, m, stride_y, TOP_K: tl.constexpr, PAIR_ORDER: tl.constexpr, CACHE: tl.constexpr
):
    """Token t's k expert outputs at ``cols``, weighted and summed in fp32 (rows from ROWS, or pair order).
    CACHE: Y's and W's load cache modifier (".cg" where other programs of the same launch wrote them: past L1)."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for s in tl.static_range(TOP_K):
        if PAIR_ORDER:
            row = t * TOP_K + s
        else:
            row = tl.load(ROWS + t * TOP_K + s)
        w = tl.load(W + t * TOP_K + s, cache_modifier=CACHE).to(tl.float32)
        acc += w * tl.load(Y + row * stride_y + cols, mask=m, other=0.0, cache_modifier=CACHE).to(tl.float32)
    return acc


@triton.jit
def _moe_combine_kernel(
    Y,  # [T*k, H] expert outputs, sorted rows
    ROWS,  # [T*k] int64 sorted row of pair t*k + s (not read with PAIR_ORDER: row t*k + s)
    W,  # [T, k] routing weights (any float dtype)
    OUT,  # [T, H]
    ADD,  # [T, H] added to the rounded sum (HAS_ADD): the shared expert's output
    H,
    stride_y,
    stride_out,
    stride_add,
    TOP_K: tl.constexpr,
    HAS_ADD: tl.constexpr,
    PAIR_ORDER: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = cols < H
    acc = weighted_expert_sum(Y, ROWS, W, t, cols, m, stride_y, TOP_K, PAIR_ORDER, "")
    if HAS_ADD:  # rounded first, then added and rounded again: bit for bit the separate `y + shared`
        add = tl.load(ADD + t.to(tl.int64) * stride_add + cols, mask=m, other=0.0).to(tl.float32)
        acc = acc.to(OUT.dtype.element_ty).to(tl.float32) + add
    tl.store(OUT + t.to(tl.int64) * stride_out + cols, acc.to(OUT.dtype.element_ty), mask=m)


def moe_combine_triton(
    y: torch.Tensor,
    rows: torch.Tensor | None,
    weights: torch.Tensor,
    out_dtype: torch.dtype,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [T*k, H], rows [T*k] int64, weights [T, k] -> [T, H] ``out_dtype`` (``grouped.moe_combine``);
    ``add`` [T, H] is added to the rounded sum in the same launch (the shared expert: one pass over [T, H]
    fewer than a separate add). rows None: y is in pair order (``moe_experts_decode``'s pair rows)."""
    check_device("moe_combine_triton", y, weights, *(() if rows is None else (rows,)))
    t, k = weights.shape
    if y.ndim != 2 or y.shape[0] != t * k or (rows is not None and rows.shape != (t * k,)):
        raise ValueError(f"y must be [T*k, H] and rows [T*k] for weights {tuple(weights.shape)}")
    y = y if y.stride(1) == 1 else y.contiguous()
    h = y.shape[1]
    if add is not None:
        if add.shape != (t, h) or add.device != y.device:
            raise ValueError(f"add must be [{t}, {h}] on {y.device}, got {tuple(add.shape)} on {add.device}")
        add = add if add.stride(1) == 1 else add.contiguous()
    out = torch.empty(t, h, dtype=out_dtype, device=y.device)
    if t == 0:
        return out
    block_h = min(1024, next_pow2(h))
    grid = (t, triton.cdiv(h, block_h))
    _moe_combine_kernel[grid](
        y,
        weights if rows is None else rows.contiguous(),  # not read in pair order
        weights.contiguous(),
        out,
        out if add is None else add,
        h,
        y.stride(0),
        out.stride(0),
        0 if add is None else add.stride(0),
        TOP_K=k,
        HAS_ADD=add is not None,
        PAIR_ORDER=rows is None,
        BLOCK_H=block_h,
        **pdl_kwargs(y, "moe.combine"),
    )
    return out


def moe_combine_auto(
    y: torch.Tensor,
    rows: torch.Tensor | None,
    weights: torch.Tensor,
    out_dtype: torch.dtype,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton combine on CUDA (or under the interpreter: the GPU backends' host tests), torch's otherwise."""
    if y.is_cuda or is_interpreting():
        return moe_combine_triton(y, rows, weights, out_dtype, add)
    return moe_combine(y, rows, weights, out_dtype, add)


__all__ = ["moe_combine_auto", "moe_combine_triton"]
