"""Reference: the greedy token of each logits row, as the sampler takes it."""

from __future__ import annotations

import torch


def naive_argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[S, V] logits (any float dtype) -> [S] int64: the index of each row's largest value, the first of equal
    maxima (torch.argmax's rule on every device). Written into ``out`` when given. Rows holding NaN are not part
    of the contract (torch takes the first NaN; the fast kernel may not)."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [S, V], got shape {tuple(logits.shape)}")
    ids = logits.argmax(dim=-1)
    if out is None:
        return ids
    return out.copy_(ids)
