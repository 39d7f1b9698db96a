"""What rank 0 sends the other ranks, and how a step is cut into pipeline microbatches.

Commands travel over the ``cmd`` group (broadcast from rank 0), one per engine call:

    StepPlan        run one step: the ForwardBatch (CPU tensors) plus fork copies and handoff streams
    ImportCommand   a P/D import follows: each rank receives its slice of the pages / state (p2p)
    CallCommand     run a function on every rank and gather the results (tests, diagnostics)
    StopCommand     leave the loop
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.forward_batch import ForwardBatch, kv_write_fields
from kernels.upload import upload


@dataclass
class StepPlan:
    batch: ForwardBatch
    """The whole step, as the scheduler made it (CPU tensors; each rank moves them to its device)."""
    forks: list[tuple[int, int]] = field(default_factory=list)
    """(checkpoint slot, request slot): KDA state copies every stage makes before the step runs."""
    num_microbatches: int = 1
    num_sampled: int = 0
    """Requests sampled (or verified) this step: rank 0 broadcasts their results after sampling."""
    sample_widths: list[int] = field(default_factory=list)
    """Per sampled request, its logits rows: 1 + its drafts (the most tokens a verify step can emit)."""
    aux_layer_ids: tuple[int, ...] = ()
    """Taps to capture at the logits rows (a drafter's, or a consumer's via the handoff); each stage
    captures those it owns and its leader sends them to rank 0."""
    handoff: dict[str, int] = field(default_factory=dict)
    """Requests streaming to a decode worker -> max message bytes (producer stages relay via rank 0)."""


@dataclass
class ImportCommand:
    request_id: str


@dataclass
class CallCommand:
    fn: Callable[[Any], Any]
    """Called with the rank's RankState; must be picklable (a module-level function)."""


@dataclass
class StopCommand:
    pass


def to_device(batch: ForwardBatch, device: torch.device) -> ForwardBatch:
    """The plan's host batch on this rank's device: uploads that do not wait for the GPU, and the rows that
    write KV read off the host slot_mapping (no device-to-host look mid-forward)."""
    if device.type == "cpu":
        return batch
    return ForwardBatch(
        input_ids=upload(batch.input_ids, device),
        positions=upload(batch.positions, device),
        query_start_loc=batch.query_start_loc,
        context_lens=batch.context_lens,
        block_tables=[upload(t, device) for t in batch.block_tables],
        slot_mapping=upload(batch.slot_mapping, device),
        state_slots=batch.state_slots,
        has_initial_state=batch.has_initial_state,
        logits_indices=upload(batch.logits_indices, device),
        request_ids=batch.request_ids,
        chunk_starts=batch.chunk_starts,
        completes_prompt=batch.completes_prompt,
        checkpoints=batch.checkpoints,
        **kv_write_fields(batch.slot_mapping, device),  # read off the host slots (~0.1 ms at 64k rows)
    )


def split_batch(batch: ForwardBatch, n: int) -> list[ForwardBatch]:
    """Cut the step's rows into up to n contiguous pieces of nearly equal size, so pipeline stages work
    on different pieces at once. A sequence cut in two continues in the next piece: on every stage the
    pieces run in order, so its KV pages and KDA state are in place when the second part runs; only the
    part that reaches the chunk's end completes the prompt; each piece keeps its own logits rows (a
    verify chunk has one per draft) and the rungs' checkpoints inside it."""
    t = batch.num_tokens
    n = max(1, min(n, t))
    if n == 1:
        return [batch]
    cuts = sorted({round(k * t / n) for k in range(n + 1)})
    return [_piece(batch, a, b) for a, b in itertools.pairwise(cuts)]


def _piece(batch: ForwardBatch, a: int, b: int) -> ForwardBatch:
    qsl, ctx, tables, slots, init, logits = [0], [], [], [], [], []
    rids, starts, completes, cks = [], [], [], []
    sampling_rows = set(batch.logits_indices.tolist())
    for i in range(batch.num_seqs):
        s, e = batch.query_start_loc[i], batch.query_start_loc[i + 1]
        u, w = max(a, s), min(b, e)
        if u >= w:
            continue
        first_pos = batch.context_lens[i] - (e - s)  # position of the chunk's first token
        part_start, part_end = first_pos + (u - s), first_pos + (w - s)
        qsl.append(qsl[-1] + (w - u))
        ctx.append(part_end)
        tables.append(batch.block_tables[i])
        slots.append(batch.state_slots[i])
        init.append(batch.has_initial_state[i] if u == s else True)
        logits += [qsl[-1] - (w - u) + (r - u) for r in range(u, w) if r in sampling_rows]
        rids.append(batch.request_ids[i] if batch.request_ids else "")
        starts.append(part_start)
        completes.append(bool(batch.completes_prompt and batch.completes_prompt[i]) and w == e)
        all_cks = batch.checkpoints[i] if batch.checkpoints else ()
        cks.append(tuple((pos, dst) for pos, dst in all_cks if part_start < pos <= part_end))
    return ForwardBatch(
        input_ids=batch.input_ids[a:b],
        positions=batch.positions[a:b],
        query_start_loc=qsl,
        context_lens=ctx,
        block_tables=tables,
        slot_mapping=batch.slot_mapping[a:b],
        state_slots=slots,
        has_initial_state=init,
        logits_indices=torch.tensor(logits, dtype=torch.int64, device=batch.input_ids.device),
        request_ids=rids,
        chunk_starts=starts,
        completes_prompt=completes,
        checkpoints=cks,
    )
