"""Reference: a dense projection of a decode step's rows, as ``F.linear`` computes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype, products summed in fp32 (what cuBLAS does for bf16)."""
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] must share K, got {tuple(x.shape)} and {tuple(weight.shape)}")
    return F.linear(x.float(), weight.float()).to(x.dtype)
