"""What the backends read in a padded static decode step, instead of the ForwardBatch's host lists."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class DecodeMeta:
    """Device views over the static buffers of one (padded batch size, context bucket) graph.

    Row i < the step's real batch is a request's one decode token; the rows after it are padding: they point
    at a reserved scratch page and scratch KDA slot and have a context of one token (their own scratch key),
    so they read no key and write nothing that is kept. Every tensor here keeps its address for the life of
    the graph; a step only rewrites contents. Backends must not read host lists of the ForwardBatch (they
    would be baked into a captured graph).
    """

    batch_size: int
    """Padded rows (== the ForwardBatch's token count)."""
    max_context: int
    """Context bucket: no row's context exceeds it (sizes the attention's key split, a host constant)."""
    context_lens: torch.Tensor  # [B] int32, tokens cached after this step (1 for padding)
    block_tables: torch.Tensor  # [B, max_context / page_size] int32 (scratch page for padding)
    state_slots: torch.Tensor  # [B] int32 KDA slot (the scratch slot for padding)
    query_start_loc: torch.Tensor  # [B + 1] int32, 0..B (one row per sequence)
    has_initial_state: torch.Tensor  # [B] int32 ones (a decode token always continues a state)
    derived: dict[Any, Any] = field(default_factory=dict)
    """Backend-built static tensors (e.g. attention work lists), made by the first (eager) run and reused by
    the capture: a tensor created while capturing would copy from host memory that is gone at replay."""

    def cached(self, key: Any, build: Any) -> Any:
        if key not in self.derived:
            self.derived[key] = build()
        return self.derived[key]
