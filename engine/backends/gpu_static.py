"""GPU backend metadata of a padded static decode step (ForwardBatch.decode_meta): built from the static
device buffers only, with no host list and no host-to-device copy of step data, so it can be captured in a
CUDA graph. Each piece is made on the step's first (eager) run and cached on the DecodeMeta.
"""

from __future__ import annotations

import torch

from engine.decode_graph.meta import DecodeMeta
from kernels.paged_attention.meta import AttnMeta, default_block_m
from kernels.paged_attention.mla import MLAPart


def static_attn_meta(meta: DecodeMeta, group: int, dv: int) -> AttnMeta:
    """One query row per sequence; work items in row order (the eager path sorts them by context length, a
    host decision a graph cannot repeat per step). max_ctx is the bucket: it fixes the key split."""
    block_m = default_block_m(group, 1, dv)
    n = meta.batch_size

    def work() -> torch.Tensor:
        items = [(i, r0) for i in range(n) for r0 in range(0, group, block_m)]
        return torch.tensor(items, dtype=torch.int32).to(meta.context_lens.device)

    return AttnMeta(
        qsl=meta.query_start_loc,
        ctx=meta.context_lens,
        block_tables=meta.block_tables,
        kv_start=None,
        work=meta.cached(("work", group, block_m), work),
        num_seqs=n,
        num_tokens=n,
        max_q_len=1,
        max_ctx=meta.max_context,
        group=group,
        block_m=block_m,
    )


def static_mla_parts(meta: DecodeMeta, num_heads: int, kv_lora_rank: int) -> list[MLAPart]:
    """Decode rows always take the absorbed form (one row per sequence is far below the expand threshold)."""
    return [MLAPart(expanded=False, rows=None, meta=static_attn_meta(meta, num_heads, kv_lora_rank), latent_rows=None)]


class KDADecodeStep:
    """The fields GPUKDABackend reads from its per-step slot bookkeeping, for an all-decode static step:
    no fresh slots, no rung copies inside the step (DecodeGraphs copies rungs after it)."""

    def __init__(self, meta: DecodeMeta) -> None:
        self.slots = meta.state_slots
        self.qsl = meta.query_start_loc
        self.has_init = meta.has_initial_state
        self.max_q_len = 1
        self.fresh = None
        self.conv_cks: list = []
        self.pre_copies: list = []
        self.all_decode = True
        self.dec_slots = meta.state_slots
        self.dec_rows = None
        self.dec_copies: list = []
        self.rounds: list = []
        self.rows_are_all = False
