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
