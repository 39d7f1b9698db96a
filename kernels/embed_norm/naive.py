"""Contract of kernels/embed_norm/triton.py in plain torch."""

from __future__ import annotations

import torch


def naive_embed_rms_norm(
    weight: torch.Tensor, ids: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(weight[ids]) * norm_weight, weight[ids])``: the embedding rows of ``ids`` and the first layer's
    input norm of them, with the GPU norm backend's numerics (fla's ``layer_norm_fwd``: normalised and scaled in
    fp32, cast to the weight's dtype)."""
    if weight.ndim != 2 or ids.ndim != 1 or norm_weight.shape != (weight.shape[1],):
        raise ValueError(
            f"weight [V, H], ids [T], norm_weight [H]; got {tuple(weight.shape)}, {tuple(ids.shape)}, "
            f"{tuple(norm_weight.shape)}"
        )
    rows = weight[ids]
    x = rows.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    return normed.to(weight.dtype), rows


__all__ = ["naive_embed_rms_norm"]
