"""Reference page gather / scatter: a request's pages <-> one contiguous buffer in token order.

Used by the P/D handoff and the prefix-cache tier. A cache is ``[num_pages, page_size, *entry]`` (one per
attention layer, all of one shape); token ``t`` of the request lives at page ``block_table[t // page_size]``,
row ``t % page_size``. The packed buffer is ``[num_layers, num_tokens, *entry]`` for tokens
``start .. start + num_tokens - 1``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def token_rows(block_table: torch.Tensor, page_size: int, start: int, num_tokens: int) -> torch.Tensor:
    """Flat cache rows (page * page_size + offset) of tokens start .. start + num_tokens - 1."""
    t = torch.arange(start, start + num_tokens, device=block_table.device)
    return block_table.to(torch.int64)[t // page_size] * page_size + t % page_size


def naive_pack_pages(
    caches: Sequence[torch.Tensor], block_table: torch.Tensor, start: int, num_tokens: int
) -> torch.Tensor:
    """Gather tokens [start, start + num_tokens) of every cache -> [L, num_tokens, *entry]."""
    rows = token_rows(block_table, caches[0].shape[1], start, num_tokens)
    return torch.stack([c.view(-1, *c.shape[2:])[rows] for c in caches])


def naive_unpack_pages(
    caches: Sequence[torch.Tensor], block_table: torch.Tensor, start: int, packed: torch.Tensor
) -> None:
    """Scatter packed [L, num_tokens, *entry] back into tokens [start, start + num_tokens) of every cache."""
    rows = token_rows(block_table, caches[0].shape[1], start, packed.shape[1])
    for c, p in zip(caches, packed, strict=True):
        c.view(-1, *c.shape[2:])[rows] = p.to(c.dtype)
