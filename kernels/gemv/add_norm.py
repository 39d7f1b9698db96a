"""A pre-norm layer's input norm (with the residual add before it) and its first projection as one launch for
one-row steps. Contract: ``naive_add_norm_gemv``.

y [1, N] = rms_norm(x + residual) * w_norm @ W^T, and the residual sum x + residual for the next layer. The norm is
over the whole row, so every program first reads the row once (a few KB, from L2: 2304 bf16 values on the Kimi
shape) for its sum of squares, then streams its ``block_n`` weight rows as the one-row GEMV does
(kernels/gemv/triton.py), normalising each block of x as it loads it. The normed values are rounded to x's dtype
before the products, as fla's fused add + norm kernel stores them, so both forms give the same bits up to the
fp32 rounding of the sum of squares. The norm's own launch (~2.3 us for one row) leaves each layer of a batch-1
decode step whose first projection is one GEMV (KDA's in_proj, MLA's q | kv_a, the dense MLP's gate | up).
Program 0 writes the residual sum; it goes to a new tensor, never over x or the residual, which the other
programs are still reading.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gemv.triton import gemv_tile
from kernels.pdl import pdl_enter, pdl_kwargs
from kernels.triton_utils import check_device


@triton.jit
def _summed_block(X, R, k0, K, HAS_RES: tl.constexpr, BLOCK_K: tl.constexpr):
    """(columns, their mask, x + residual in fp32) of the row's block at k0."""
    o_k = k0 + tl.arange(0, BLOCK_K)
    m_k = o_k < K
    s = tl.load(X + o_k, mask=m_k, other=0.0).to(tl.float32)
    if HAS_RES:
        s += tl.load(R + o_k, mask=m_k, other=0.0).to(tl.float32)
    return o_k, m_k, s


@triton.jit
def _add_norm_gemv_kernel(
    X,  # [K]
    R,  # [K] the residual (HAS_RES)
    NW,  # [K] the norm's weight
    W,  # [N, K]
    Y,  # [N]
    R_OUT,  # [K] x + residual (HAS_RES), written by program 0
    N,
    K,
    stride_w,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k, m_k, s = _summed_block(X, R, k0, K, HAS_RES, BLOCK_K)
        if HAS_RES and pid == 0:
            tl.store(R_OUT + o_k, s.to(R_OUT.dtype.element_ty), mask=m_k)
        squares += s * s
    rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)

    o_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past N read row N - 1 (their results are not stored), so the weight loads need no row mask
    w_rows = W + tl.minimum(o_n, N - 1).to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k, m_k, s = _summed_block(X, R, k0, K, HAS_RES, BLOCK_K)
        nw = tl.load(NW + o_k, mask=m_k, other=0.0).to(tl.float32)
        xn = (s * rstd * nw).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(w_rows + o_k[None, :], mask=m_k[None, :], other=0.0)
        acc += w.to(tl.float32) * xn[None, :]
    tl.store(Y + o_n, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=o_n < N)


def add_norm_gemv_fits(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Shapes the kernel takes: one row, unit column strides, one dtype."""
    return (
        x.ndim == 2
        and x.shape[0] == 1
        and weight.ndim == 2
        and x.shape[1] == weight.shape[1] > 0
        and x.dtype == weight.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1))
    )


def add_norm_gemv(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [1, K] (residual None: x is the whole input), norm_weight [K], weight [N, K] -> (y [1, N] in x's
    dtype, the residual sum [1, K]: a new tensor, or x itself without a residual)."""
    check_device("add_norm_gemv", x, norm_weight, weight, *(() if residual is None else (residual,)))
    if not add_norm_gemv_fits(x, residual, weight) or norm_weight.shape != (x.shape[-1],):
        raise ValueError(
            f"add_norm_gemv takes x (and residual) [1, K] and weight [N, K] of one dtype with unit column strides, "
            f"norm_weight [K]; got x {tuple(x.shape)}, residual {None if residual is None else tuple(residual.shape)}, "
            f"weight {tuple(weight.shape)}, norm_weight {tuple(norm_weight.shape)}"
        )
    n, k = weight.shape
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    res_out = x if residual is None else torch.empty_like(x)
    if n == 0:
        if residual is not None:
            torch.add(x, residual, out=res_out)
        return out, res_out
    tile = gemv_tile(1, n, k)
    _add_norm_gemv_kernel[(triton.cdiv(n, tile.block_n),)](
        x,
        x if residual is None else residual,
        norm_weight.contiguous(),
        weight,
        out,
        res_out,
        n,
        k,
        weight.stride(0),
        float(eps),
        HAS_RES=residual is not None,
        BLOCK_N=tile.block_n,
        BLOCK_K=min(tile.block_k, triton.next_power_of_2(k)),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **pdl_kwargs(x, "gemv.add_norm"),
    )
    return out, res_out


__all__ = ["add_norm_gemv", "add_norm_gemv_fits"]
