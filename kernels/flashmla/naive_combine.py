"""The contract of the split-KV combine (``kernels/flashmla/combine.py``): FlashMLA's ``combine.cu`` in plain
PyTorch, fp32, one request at a time.

The split kernel leaves, for every request r with more than one split, its splits' partial outputs
``o_accum[s, h, :]`` (each normalised by its own softmax sum) and their log-sums ``lse_accum[s, h]`` in base 2,
for s in ``num_splits[r] .. num_splits[r + 1] - 1``. The combine weighs each split by ``2^(lse_s - lse)``, where
``lse = log2(sum_s 2^lse_s)``, and writes the sum to ``out[r]`` in out's dtype. A request with one split was
written by the split kernel itself: its rows of ``out`` are left as they are. A request whose splits are all
``-inf`` (no keys) gets zeros, as FlashMLA's (its global lse is +inf, so every weight is 0).
"""

from __future__ import annotations

import torch


def naive_split_combine(
    o_accum: torch.Tensor, lse_accum: torch.Tensor, num_splits: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """o_accum [S, H, D] fp32, lse_accum [S, H] fp32 (log2), num_splits [B + 1] cumulative, out [B, H, D]:
    combines every multi-split request into ``out`` in place and returns it."""
    cum = [int(n) for n in num_splits.tolist()]
    for r in range(out.shape[0]):
        lo, hi = cum[r], cum[r + 1]
        if hi - lo <= 1:
            continue
        lse = lse_accum[lo:hi].float()  # [n, H]
        top = lse.max(dim=0).values
        top = torch.where(top == -torch.inf, torch.zeros_like(top), top)
        total = torch.exp2(lse - top).sum(dim=0)
        glob = torch.where(total == 0, torch.full_like(total, torch.inf), torch.log2(total) + top)
        weight = torch.exp2(lse - glob)  # [n, H]
        out[r] = (weight[:, :, None] * o_accum[lo:hi].float()).sum(dim=0).to(out.dtype)
    return out


__all__ = ["naive_split_combine"]
