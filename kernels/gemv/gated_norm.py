"""KDA's output norm and output projection as one launch for one-row steps. Contract: ``naive_gated_norm_gemv``.

y [1, N] = (rms_norm_per_head(x) * w_norm * sigmoid(gate)) @ W^T, x and gate [1, H * D]. The norm is over each
head's D columns, so a program that walks K in blocks of whole heads can normalise every block it loads by itself:
the normed activation never goes to memory, and the norm's own launch (fla's gated norm kernel, ~2.5 us for a
16 KB row) leaves the batch-1 decode step, once per KDA layer. The normed values are rounded to x's dtype before
the products, as the two-launch form stores them, so both give the same bits up to the norm's fp32 rounding.
The weight stream is the one-row GEMV's (kernels/gemv/triton.py): a program owns ``block_n`` weight rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gemv.norm_after import NormAfter, no_norm_after_args, norm_after_last_program, norm_after_outputs
from kernels.gemv.triton import gemv_tile
from kernels.pdl import pdl_enter, pdl_kwargs
from kernels.triton_utils import check_device, next_pow2


@triton.jit
def _gated_norm_gemv_kernel(
    X,  # [K] = [H * D]
    G,  # [K] the gate's logits
    NW,  # [D] the norm's weight
    W,  # [N, K]
    Y,  # [N]
    N,
    K,
    stride_w,
    eps,
    RES,  # the norm after (NORM_AFTER): kernels/gemv/norm_after.py
    NW_AFTER,
    OUT,
    RES_OUT,
    TICKET,
    eps_after,
    D: tl.constexpr,
    HEADS: tl.constexpr,  # heads a K block holds
    BLOCK_N: tl.constexpr,
    NORM_AFTER: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past N read row N - 1 (not stored), so the weight loads need no mask
    w_rows = W + tl.minimum(o_n, N - 1).to(tl.int64)[:, None, None] * stride_w
    o_hd = tl.arange(0, HEADS)[:, None] * D + tl.arange(0, D)[None, :]  # [HEADS, D]
    nw = tl.load(NW + tl.arange(0, D)).to(tl.float32)[None, :]
    acc = tl.zeros([BLOCK_N, HEADS, D], dtype=tl.float32)
    for k0 in range(0, K, HEADS * D):
        x = tl.load(X + k0 + o_hd).to(tl.float32)
        g = tl.load(G + k0 + o_hd).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        xn = (nw * (x * rstd[:, None]) * tl.sigmoid(g)).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(w_rows + (k0 + o_hd)[None, :, :])
        acc += w.to(tl.float32) * xn[None, :, :]
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    tl.store(Y + o_n, y.to(Y.dtype.element_ty), mask=o_n < N)
    if NORM_AFTER:
        norm_after_last_program(Y, RES, NW_AFTER, OUT, RES_OUT, TICKET, N, eps_after, BLOCK_H)


def gated_norm_gemv_fits(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, head_dim: int) -> bool:
    """Shapes the kernel takes: one row, unit column strides, one dtype, a power-of-two head size dividing K."""
    k = weight.shape[-1] if weight.ndim == 2 else -1
    return (
        x.ndim == 2
        and x.shape == gate.shape
        and x.shape[0] == 1
        and x.shape[1] == k
        and x.dtype == gate.dtype == weight.dtype
        and x.stride(1) == 1
        and gate.stride(1) == 1
        and weight.stride(1) == 1
        and head_dim == next_pow2(head_dim)
        and k % head_dim == 0
        and k > 0
    )


def gated_norm_gemv(
    x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> torch.Tensor:
    """x, gate [1, H * D] (D = norm_weight's size), weight [N, H * D] -> [1, N] in x's dtype."""
    out = _checked_out(x, gate, norm_weight, weight)
    if out.shape[1]:
        _launch(x, gate, norm_weight, eps, weight, out, None)
    return out


def gated_norm_gemv_norm_after(
    x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, after: NormAfter
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gated_norm_gemv``, then the norm after it by the launch's last program (kernels/gemv/norm_after.py) ->
    (the norm's output [1, N] in x's dtype, after.residual + y [1, N] in the residual's dtype)."""
    y = _checked_out(x, gate, norm_weight, weight)
    if y.shape[1] == 0:
        raise ValueError("gated_norm_gemv_norm_after needs N > 0 outputs")
    out, res_out, args = norm_after_outputs(after, y, "gated_norm_gemv_norm_after")
    _launch(x, gate, norm_weight, eps, weight, y, args)
    return out, res_out


def _checked_out(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    check_device("gated_norm_gemv", x, gate, norm_weight, weight)
    if norm_weight.ndim != 1 or not gated_norm_gemv_fits(x, gate, weight, norm_weight.numel()):
        raise ValueError(
            f"gated_norm_gemv takes x, gate [1, K] and weight [N, K] of one dtype with unit column strides, K a "
            f"multiple of the power-of-two head size; got x {tuple(x.shape)}, gate {tuple(gate.shape)}, weight "
            f"{tuple(weight.shape)}, norm_weight {tuple(norm_weight.shape)}"
        )
    return torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)


def _launch(
    x: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    out: torch.Tensor,
    after: dict[str, object] | None,
) -> None:
    d = norm_weight.numel()
    n, k = weight.shape
    tile = gemv_tile(1, n, k)
    heads = 1 << (max(1, min(tile.block_k, k) // d).bit_length() - 1)  # a power of two
    while (k // d) % heads:  # whole heads a block, the blocks tiling K exactly
        heads //= 2
    norm_after, after = after is not None, after or no_norm_after_args(out)
    _gated_norm_gemv_kernel[(triton.cdiv(n, tile.block_n),)](
        x,
        gate,
        norm_weight.contiguous(),
        weight,
        out,
        n,
        k,
        weight.stride(0),
        float(eps),
        after["RES"],
        after["NW"],
        after["OUT"],
        after["RES_OUT"],
        after["TICKET"],
        after["eps"],
        D=d,
        HEADS=heads,
        BLOCK_N=tile.block_n,
        NORM_AFTER=norm_after,
        BLOCK_H=after["BLOCK_H"],
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **pdl_kwargs(x, "gemv.gated_norm"),
    )


__all__ = ["gated_norm_gemv", "gated_norm_gemv_fits", "gated_norm_gemv_norm_after"]
