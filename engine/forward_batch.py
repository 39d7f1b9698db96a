"""What one model step sees: a flat batch of tokens from several requests plus cache metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from kernels.upload import upload

if TYPE_CHECKING:
    from engine.decode_graph.meta import DecodeMeta


@dataclass
class ForwardBatch:
    """Tokens of all scheduled requests, concatenated ("varlen").

    Sequence i owns rows query_start_loc[i]:query_start_loc[i+1]; those are its tokens at
    positions context_lens[i] - q_len .. context_lens[i] - 1.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_start_loc: list[int]  # [N + 1]
    context_lens: list[int]  # [N] tokens cached after this step
    block_tables: list[torch.Tensor]  # N x [pages] int64
    slot_mapping: torch.Tensor  # [T] flat KV row (page * page_size + offset); -1: KV reused from the prefix cache
    state_slots: list[int]  # [N] KDA slot of each sequence (-1 without KDA layers)
    has_initial_state: list[bool]  # [N] False on a request's first chunk: start from zero state
    logits_indices: torch.Tensor  # [S] rows whose next-token logits are needed
    request_ids: list[str] = field(default_factory=list)  # [N]
    chunk_starts: list[int] = field(default_factory=list)  # [N] tokens cached before this step
    completes_prompt: list[bool] = field(default_factory=list)  # [N] this chunk reaches the last known token
    checkpoints: list[tuple[tuple[int, int], ...]] = field(default_factory=list)
    """[N] (rung position, slot): after that many tokens, copy the KDA state (recurrent + conv) to slot."""
    kv_write_rows: torch.Tensor | None = None
    """Rows whose slot_mapping is >= 0, when the builder knows them on the host (device, int64); with
    ``all_kv_written`` it spares the GPU backend a device-to-host look at slot_mapping mid-forward."""
    all_kv_written: bool = False
    """The builder knows that no row reuses cached KV (no -1 in slot_mapping)."""
    decode_meta: DecodeMeta | None = None
    """Set on a padded static decode step (engine/decode_graph): the GPU backends read its device tensors
    and never the host lists above, which a captured CUDA graph would freeze."""

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def q_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]

    @property
    def is_decode_only(self) -> bool:
        return self.num_tokens == self.num_seqs


def kv_write_fields(slot_mapping: list[int] | torch.Tensor, device: torch.device) -> dict:
    """``kv_write_rows`` / ``all_kv_written`` of a host slot_mapping, as ForwardBatch keyword arguments."""
    host = torch.as_tensor(slot_mapping, dtype=torch.int64).cpu().numpy()  # numpy: no torch CPU op per step
    keep = host >= 0
    if keep.all():
        return {"all_kv_written": True}
    return {"kv_write_rows": upload(torch.from_numpy(keep.nonzero()[0].astype(np.int64)), device)}
