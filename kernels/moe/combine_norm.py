"""The MoE combine of one-token steps with the next norm in the same launch: the token's k expert outputs
weighted and summed (``combine.py``), the residual added, and RMSNorm over the sum — what ``moe_combine`` then the
next layer's ``RMSNorm.add`` (fla's ``layer_norm_fwd`` with a residual) compute, in one program a token.

Why: a one-token decode step ran each of those norms as its own one-program launch, 17 of ~110 a step at 2.6 us
each on the H100 (docs/PERFORMANCE.md, twenty-ninth session's kernel table): pure launch latency. The combine's
three programs already hold the row's columns; one program holding all of them can also reduce over the row.

Numerics are fla's fused add-norm on the combine's output: the sum rounded to the output dtype (as the
separate combine stores it), plus the residual in fp32; that fp32 sum is stored as the new residual (in the
residual's dtype) and normalised: ``y = s * rsqrt(mean(s^2) + eps) * w`` in fp32, cast to the output dtype.
Contract: ``naive_combine_add_norm``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gemv.naive import add_rms_norm_reference
from kernels.moe.combine import weighted_expert_sum
from kernels.moe.grouped import moe_combine
from kernels.pdl import pdl_enter, pdl_kwargs
from kernels.triton_utils import check_device, next_pow2


@triton.jit
def combine_add_norm_row(
    Y, ROWS, W, RESIDUAL, NORM_W, OUT, RES_OUT, t, H, eps, stride_y, stride_res, stride_out, stride_res_out,
    TOP_K: tl.constexpr, PAIR_ORDER: tl.constexpr, BLOCK_H: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """Token t's combine, residual add and norm over its whole row (BLOCK_H >= H). CACHE: Y's load cache modifier
    (".cg" in the MoE down launch's last program, kernels/moe/down_norm.py: other SMs wrote Y)."""
    cols = tl.arange(0, BLOCK_H)
    m = cols < H
    x = combine_add_cols(
        Y, ROWS, W, RESIDUAL, OUT, RES_OUT, t, cols, m, stride_y, stride_res, stride_res_out, TOP_K, PAIR_ORDER, CACHE
    )
    norm_row(x, m, NORM_W, OUT, t, cols, H, eps, stride_out)


@triton.jit
def combine_add_cols(
    Y, ROWS, W, RESIDUAL, OUT, RES_OUT, t, cols, m, stride_y, stride_res, stride_res_out,
    TOP_K: tl.constexpr, PAIR_ORDER: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """Token t's combine at ``cols`` rounded to OUT's dtype (as the separate combine stores it), plus the residual
    in fp32: stored as the new residual in RES_OUT's dtype, returned in fp32 (the norm's input)."""
    acc = weighted_expert_sum(Y, ROWS, W, t, cols, m, stride_y, TOP_K, PAIR_ORDER, CACHE)
    x = acc.to(OUT.dtype.element_ty).to(tl.float32)
    x += tl.load(RESIDUAL + t * stride_res + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(RES_OUT + t * stride_res_out + cols, x.to(RES_OUT.dtype.element_ty), mask=m)
    return x


@triton.jit
def norm_row(x, m, NORM_W, OUT, t, cols, H, eps, stride_out):
    """fla's RMSNorm of token t's fp32 row x (``cols`` covering all H, ``m`` its mask) into OUT."""
    xm = tl.where(m, x, 0.0)
    rstd = 1 / tl.sqrt(tl.sum(xm * xm, axis=0) / H + eps)
    nw = tl.load(NORM_W + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + t * stride_out + cols, (x * rstd * nw).to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _moe_combine_add_norm_kernel(
    Y,  # [T*k, H] expert outputs, sorted rows
    ROWS,  # [T*k] int64 sorted row of pair t*k + s (not read with PAIR_ORDER)
    W,  # [T, k] routing weights
    RESIDUAL,  # [T, H]
    NORM_W,  # [H]
    OUT,  # [T, H] the norm's output
    RES_OUT,  # [T, H] residual + the combine's output
    H,
    eps,
    stride_y,
    stride_res,
    stride_out,
    stride_res_out,
    TOP_K: tl.constexpr,
    PAIR_ORDER: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= H: the whole row in one program
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    combine_add_norm_row(
        Y, ROWS, W, RESIDUAL, NORM_W, OUT, RES_OUT, tl.program_id(0).to(tl.int64), H, eps, stride_y, stride_res,
        stride_out, stride_res_out, TOP_K, PAIR_ORDER, BLOCK_H, "",
    )  # fmt: skip


def moe_combine_add_norm(
    y: torch.Tensor,
    rows: torch.Tensor | None,
    weights: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + combine), residual + combine): y [T*k, H] expert outputs, rows [T*k] int64 (None: y in pair
    order), weights [T, k], residual [T, H], norm_weight [H]. The combine's output is rounded to ``out_dtype``
    first, as ``moe_combine`` returns it; the norm's output is ``out_dtype``, the new residual residual's dtype."""
    check_device("moe_combine_add_norm", y, weights, residual, norm_weight, *(() if rows is None else (rows,)))
    t, k = weights.shape
    if y.ndim != 2 or y.shape[0] != t * k or (rows is not None and rows.shape != (t * k,)):
        raise ValueError(f"y must be [T*k, H] and rows [T*k] for weights {tuple(weights.shape)}")
    h = y.shape[1]
    if residual.shape != (t, h) or norm_weight.shape != (h,):
        raise ValueError(
            f"residual {tuple(residual.shape)} / norm_weight {tuple(norm_weight.shape)} must be [{t}, {h}] / [{h}]"
        )
    y = y if y.stride(1) == 1 else y.contiguous()
    residual = residual if residual.stride(1) == 1 else residual.contiguous()
    out = torch.empty(t, h, dtype=out_dtype, device=y.device)
    res_out = torch.empty(t, h, dtype=residual.dtype, device=y.device)
    if t == 0:
        return out, res_out
    block_h = next_pow2(h)
    _moe_combine_add_norm_kernel[(t,)](
        y,
        weights if rows is None else rows.contiguous(),  # not read in pair order
        weights.contiguous(),
        residual,
        norm_weight.contiguous(),
        out,
        res_out,
        h,
        float(eps),
        y.stride(0),
        residual.stride(0),
        out.stride(0),
        res_out.stride(0),
        TOP_K=k,
        PAIR_ORDER=rows is None,
        BLOCK_H=block_h,
        num_warps=min(max(block_h // 512, 1), 8),
        **pdl_kwargs(y, "moe.combine"),
    )
    return out, res_out


def naive_combine_add_norm(
    y: torch.Tensor,
    rows: torch.Tensor | None,
    weights: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract: ``moe_combine``, then ``add_rms_norm_reference``."""
    return add_rms_norm_reference(moe_combine(y, rows, weights, out_dtype), residual, norm_weight, eps)


__all__ = [
    "add_rms_norm_reference",
    "combine_add_cols",
    "combine_add_norm_row",
    "moe_combine_add_norm",
    "naive_combine_add_norm",
    "norm_row",
]
