"""One row through a weight per head: out[h, :] = x[h, :] @ W[h] (W[h] is [K, N] by strides). MLA's absorbed
decode does two of these a layer at one query: q_nope through W_UK into the latent query, the attention's latent
output through W_UV^T. Contract: ``naive_head_gemv`` (kernels/gemv/naive.py).

At batch 1 cuBLAS ran each as a batched GEMM of M = 1 (4.0-4.2 us on the H100 for 4 MB of weights, ~1.4 us of
bytes), and FlashMLA's query needed a second launch for its rope columns. Here a program owns ``block_n`` output
columns of one head and walks K, fp32 products accumulated elementwise and reduced once (the skinny GEMM's one-row
form, kernels/gemv/triton.py); optionally the programs of column block 0 also copy a few more columns of the head
beside the output (``tail``: the rope part of FlashMLA's query).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_utils import check_device, next_pow2


@triton.jit
def _head_gemv_kernel(
    X,  # [H, K] (row stride stride_xh)
    W,  # [H, K, N] by strides
    Y,  # [H, N] (row stride stride_yh)
    TAIL,  # [H, T_COLS] copied to Y[h, N : N + T_COLS]
    N,
    K,
    stride_xh,
    stride_wh,
    stride_wk,
    stride_wn,
    stride_yh,
    stride_th,
    T_COLS,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_TAIL: tl.constexpr,
):
    h = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    o_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    w_cols = W + h * stride_wh + o_n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        x = tl.load(X + h * stride_xh + o_k, mask=m_k, other=0.0)
        w = tl.load(w_cols + o_k[:, None] * stride_wk, mask=m_k[:, None] & m_n[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[:, None]
    y = tl.sum(acc, axis=0)
    tl.store(Y + h * stride_yh + o_n, y.to(Y.dtype.element_ty), mask=m_n)
    if HAS_TAIL:  # noqa: SIM102 (a constexpr branch, then a runtime one: Triton folds the first)
        if nb == 0:
            o_t = tl.arange(0, BLOCK_T)
            m_t = o_t < T_COLS
            t = tl.load(TAIL + h * stride_th + o_t, mask=m_t, other=0.0)
            tl.store(Y + h * stride_yh + N + o_t, t.to(Y.dtype.element_ty), mask=m_t)


def head_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    tail: torch.Tensor | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """x [H, K] (unit column stride) times weight [H, K, N] (any strides: a transposed view works) -> [H, N] in x's
    dtype, fp32 sums. ``out``: an [H, N] view (unit column stride) to write, e.g. columns of a wider buffer; with
    ``tail`` [H, C] (unit column stride) the launch also copies it into ``out``'s next C columns of each head
    (``out`` must then be a view into a buffer at least N + C wide)."""
    check_device("head_gemv", x, weight, *(t for t in (out, tail) if t is not None))
    if x.ndim != 2 or weight.ndim != 3 or weight.shape[:2] != x.shape:
        raise ValueError(f"head_gemv: x [H, K] and weight [H, K, N], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.stride(1) != 1:
        raise ValueError(f"head_gemv: x must be {weight.dtype} (the weight's) with a unit column stride")
    h, k = x.shape
    n = weight.shape[2]
    if out is None:
        out = torch.empty(h, n, dtype=x.dtype, device=x.device)
    if out.shape != (h, n) or out.dtype != x.dtype or (n and out.stride(1) != 1):
        raise ValueError(f"head_gemv: out must be [{h}, {n}] {x.dtype} with a unit column stride")
    cols = 0
    if tail is not None:
        cols = tail.shape[1]
        if tail.ndim != 2 or tail.shape[0] != h or (cols and tail.stride(1) != 1):
            raise ValueError(f"head_gemv: tail must be [{h}, C] with a unit column stride, got {tuple(tail.shape)}")
        if h > 1 and out.stride(0) < n + cols:
            raise ValueError(f"head_gemv: out's rows ({out.stride(0)} apart) leave no room for {cols} tail columns")
    if h == 0 or n == 0:
        return out
    bn = block_n or (64 if n >= 256 else 16)
    block_k = max(16, min(next_pow2(k), 8192 // bn))
    _head_gemv_kernel[(h, triton.cdiv(n, bn))](
        x, weight, out, tail if tail is not None else x,
        n, k, x.stride(0), weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0),
        tail.stride(0) if tail is not None else 0, cols,
        BLOCK_N=bn, BLOCK_K=block_k, BLOCK_T=next_pow2(cols) if cols else 1, HAS_TAIL=bool(cols), num_warps=4,
    )  # fmt: skip
    return out


__all__ = ["head_gemv"]
