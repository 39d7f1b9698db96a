"""Reference: a dense projection of a decode step's rows, as ``F.linear`` computes it, and the norms the fused
one-row kernels run before or after it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype, products summed in fp32 (what cuBLAS does for bf16)."""
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] must share K, got {tuple(x.shape)} and {tuple(weight.shape)}")
    return F.linear(x.float(), weight.float()).to(x.dtype)


def naive_gated_norm_gemv(
    x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> torch.Tensor:
    """KDA's output norm, then its projection, as two steps: each head's D = norm_weight.numel() columns of x
    [M, H * D] RMS-normed in fp32, times the norm's weight and sigmoid(gate), rounded to x's dtype (what the norm
    stores), then ``naive_gemv`` with weight [N, H * D]."""
    m, k = x.shape
    d = norm_weight.numel()
    if gate.shape != x.shape or k % d:
        raise ValueError(f"x and gate [M, H * {d}] must match, got {tuple(x.shape)} and {tuple(gate.shape)}")
    xf = x.float().view(m, k // d, d)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = norm_weight.float() * normed * torch.sigmoid(gate.float().view(m, k // d, d))
    return naive_gemv(y.to(x.dtype).view(m, k), weight)


def naive_add_norm_gemv(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm layer's input norm, then its first projection, as two steps (fla's fused add + RMS norm, then
    ``naive_gemv``): s = x + residual in fp32 (x alone without one), RMS-normed over the row, times the norm's
    weight, rounded to x's dtype (what the norm stores), then @ weight [N, K]^T. Returns (y [M, N], the residual
    sum rounded to x's dtype — x itself when there is no residual)."""
    if x.ndim != 2 or (residual is not None and residual.shape != x.shape) or norm_weight.shape != (x.shape[1],):
        raise ValueError(
            f"x [M, K], residual like x, norm_weight [K]; got {tuple(x.shape)}, "
            f"{None if residual is None else tuple(residual.shape)}, {tuple(norm_weight.shape)}"
        )
    s = x.float() if residual is None else x.float() + residual.float()
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    return naive_gemv(normed.to(x.dtype), weight), (x if residual is None else s.to(x.dtype))


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's ``layer_norm_fwd(x, weight, residual=residual, is_rms_norm=True)`` in torch: the sum in fp32, stored in
    residual's dtype, normalised in fp32 and cast to x's dtype (the GPU norm backend's numerics)."""
    s = x.float() + residual.float()
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return normed.to(x.dtype), s.to(residual.dtype)


def naive_gemv_norm_after(
    y: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm after a projection (kernels/gemv/norm_after.py) on the projection's output y as it stores it
    (``naive_gemv`` or ``naive_gated_norm_gemv``): ``add_rms_norm_reference(y, residual, ...)``."""
    if y.ndim != 2 or residual.shape != y.shape or norm_weight.shape != (y.shape[1],):
        raise ValueError(
            f"y [M, N], residual like y, norm_weight [N]; got {tuple(y.shape)}, {tuple(residual.shape)}, "
            f"{tuple(norm_weight.shape)}"
        )
    return add_rms_norm_reference(y, residual, norm_weight, eps)


def naive_head_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """out[h] = x[h] @ weight[h]: x [H, K], weight [H, K, N] -> [H, N] in x's dtype, fp32 sums (kernels/gemv/heads.py;
    one query of MLA's absorbed decode through W_UK or W_UV^T)."""
    if x.ndim != 2 or weight.ndim != 3 or weight.shape[:2] != x.shape:
        raise ValueError(f"x [H, K] and weight [H, K, N], got {tuple(x.shape)} and {tuple(weight.shape)}")
    return torch.bmm(x.float()[:, None, :], weight.float())[:, 0].to(x.dtype)
