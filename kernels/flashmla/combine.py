"""The split-KV combine of FlashMLA's dense decode as a Triton kernel (contract: ``naive_combine.py``).

Why not FlashMLA's ``combine.cu``: it gives each query head one warp that walks the request's splits one after
another, each split's row a load that depends on nothing but is issued only one split ahead, on
``batch x heads / 8`` CTAs. At batch 1 (4 CTAs for 32 heads) that walk is the whole cost: 30.5 us a layer for a
32k context in 128 splits, 6.7 us for 4k in 16, on the H100 (docs/PERFORMANCE.md, twenty-ninth session), where
the data is 8.4 MB and 1 MB. Here one program takes one (request, head, slice of ``BLOCK_D`` dims) and loads
``SPLIT_BLOCK`` splits' rows at once, so a request's splits are read by ``heads x D / BLOCK_D`` programs in a few
rounds of loads instead of one serial chain.

Sums run in a different order from FlashMLA's (a tree over each chunk of splits, not split by split), so the bf16
outputs may differ from its combine by a rounding; against the fp32 contract both are within bf16 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_utils import check_device, next_pow2


@triton.jit
def _split_combine_kernel(
    O_ACCUM,  # [S, H, D] fp32
    LSE_ACCUM,  # [S, H] fp32, base 2
    NUM_SPLITS,  # [B + 1] int32, cumulative
    OUT,  # [B, H, D]
    stride_os,
    stride_oh,
    stride_ls,
    stride_ob,
    stride_oh_out,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MAX_SPLITS: tl.constexpr,  # >= any request's splits, a power of 2
    SPLIT_BLOCK: tl.constexpr,  # splits loaded at once
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    d0 = tl.program_id(2) * BLOCK_D
    lo = tl.load(NUM_SPLITS + r)
    n = tl.load(NUM_SPLITS + r + 1) - lo
    # the request's global lse (log2): every split's lse at once
    offs_all = tl.arange(0, MAX_SPLITS)
    lse = tl.load(LSE_ACCUM + (lo + offs_all) * stride_ls + h, mask=offs_all < n, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp2(lse - top), axis=0)
    glob = tl.where(total == 0.0, float("inf"), tl.log2(total) + top)
    offs_d = d0 + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    offs_s = tl.arange(0, SPLIT_BLOCK)
    for s0 in range(0, n, SPLIT_BLOCK):
        s = s0 + offs_s
        live = s < n
        w = tl.exp2(tl.load(LSE_ACCUM + (lo + s) * stride_ls + h, mask=live, other=float("-inf")) - glob)
        o = tl.load(
            O_ACCUM + (lo + s)[:, None] * stride_os + h * stride_oh + offs_d[None, :],
            mask=live[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        acc += tl.sum(w[:, None] * o, axis=0)
    # one split: the split kernel wrote this request's out itself
    d_end = tl.where(n > 1, D, 0)
    tl.store(OUT + r * stride_ob + h * stride_oh_out + offs_d, acc.to(OUT.dtype.element_ty), mask=offs_d < d_end)


def split_combine(
    o_accum: torch.Tensor,
    lse_accum: torch.Tensor,
    num_splits: torch.Tensor,
    out: torch.Tensor,
    max_splits: int,
    block_d: int = 128,
    split_block: int = 32,
) -> torch.Tensor:
    """``naive_split_combine``'s result in place in ``out`` [B, H, D] (rows of one-split requests untouched).

    o_accum [S, H, D] / lse_accum [S, H] fp32 with unit last strides; num_splits [B + 1] int32 on the device (read
    there only: graph-safe); max_splits: a host bound on any request's split count (the plan's grid parts + 1
    does: ``combine_max_splits``)."""
    b, h, d = out.shape
    check_device("split_combine", o_accum, lse_accum, num_splits, out)
    if o_accum.dtype != torch.float32 or lse_accum.dtype != torch.float32:
        raise ValueError(f"o_accum / lse_accum must be fp32, got {o_accum.dtype} / {lse_accum.dtype}")
    if o_accum.ndim != 3 or o_accum.shape[1:] != (h, d) or lse_accum.shape != o_accum.shape[:2]:
        raise ValueError(
            f"o_accum {tuple(o_accum.shape)} / lse_accum {tuple(lse_accum.shape)} must be [S, {h}, {d}] / [S, {h}]"
        )
    if o_accum.stride(2) != 1 or lse_accum.stride(1) != 1 or out.stride(2) != 1:
        raise ValueError("o_accum, lse_accum and out need a unit stride on their last axis")
    if num_splits.dtype != torch.int32 or num_splits.shape != (b + 1,):
        raise ValueError(f"num_splits must be int32 [{b + 1}], got {num_splits.dtype} {tuple(num_splits.shape)}")
    if max_splits < 1 or block_d < 1 or block_d & (block_d - 1) or split_block < 1 or split_block & (split_block - 1):
        raise ValueError(
            f"max_splits {max_splits} must be >= 1, block_d {block_d} / split_block {split_block} powers of 2"
        )
    if b == 0:
        return out
    cap = next_pow2(max_splits)
    _split_combine_kernel[(b, h, triton.cdiv(d, block_d))](
        o_accum,
        lse_accum,
        num_splits,
        out,
        o_accum.stride(0),
        o_accum.stride(1),
        lse_accum.stride(0),
        out.stride(0),
        out.stride(1),
        D=d,
        BLOCK_D=block_d,
        MAX_SPLITS=cap,
        SPLIT_BLOCK=min(split_block, cap),
        num_warps=4,
    )
    return out


__all__ = ["split_combine"]
