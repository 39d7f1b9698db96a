"""Reference depthwise causal short convolution with a carried window (KDA's q/k/v conv).

The window holds the last W-1 *pre-conv* inputs of the sequence so far, oldest first, so a sequence
can be fed in any number of pieces and give the same result as one piece.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_short_conv(
    x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C]; weight [C, W]; window [C, W-1] or None (zeros). Returns (silu(conv) [T, C], new window)."""
    c, w = weight.shape
    if window is None:
        window = x.new_zeros(c, w - 1)
    xs = torch.cat([window.to(x.dtype), x.t()], dim=-1)  # [C, W-1+T]
    y = F.conv1d(xs[None].to(weight.dtype), weight[:, None, :], groups=c)[0]  # [C, T]
    return F.silu(y).t().to(x.dtype), xs[:, xs.shape[1] - (w - 1) :].clone()


def naive_low_rank_up(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """KDA's f_b | g_b up-projections: a [T, 2, K] (f_a | g_a), b [2, P, K] -> [2, T, P] = a[:, j] @ b[j]^T, fp32
    sums rounded to a's dtype (the batched GEMM the model runs, ``KimiDeltaAttention._mix``)."""
    if a.ndim != 3 or a.shape[1] != 2 or b.ndim != 3 or b.shape[0] != 2 or a.shape[2] != b.shape[2]:
        raise ValueError(f"a must be [T, 2, K] and b [2, P, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    return torch.bmm(a.float().transpose(0, 1), b.float().transpose(1, 2)).to(a.dtype)
