"""The segment layout of a PCP step: where each rank runs the KDA token mixer.

PCP stripes a step's rows round-robin (row g on rank g % pcp). KDA is a recurrence along the sequence, so
its layers run in another layout: every sequence is cut into pcp contiguous, chunk-aligned segments
(``kda_scan.segment_bounds``, rank 0 first and longest) and rank r runs the whole mixer — projections,
short conv, recurrence, output gate and projection — on its segments. Moving the mixer's *input* (the
normed hidden state, ``hidden`` values a token) and its output costs far less than gathering what the
recurrence reads (q|k|v, the fp32 decay g and beta: 4x to 10x more bytes a token for Kimi-Linear).

A segment that does not start its sequence is preceded by ``HALO`` rows of the previous segment, so the
short conv sees its window; their outputs are computed and dropped.

Moving rows between layouts is one all-to-all (``RowExchange``): each rank sends, per destination, the
rows it holds that the destination needs, in the destination's order, and the receiver puts them in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch
from engine.parallel.groups import ParallelGroups
from engine.parallel.kda_scan import segment_bounds

HALO = 7  # rows before a segment for the short conv's window (kernel size up to 8; Kimi-Linear: 4)


@dataclass(frozen=True)
class RowExchange:
    """One all-to-all that moves rows from one layout to another (host-planned, device index tensors)."""

    send_index: torch.Tensor  # rows of the source layout to send, grouped by destination rank
    send_counts: list[int]
    recv_index: torch.Tensor  # target row of every received row, in arrival order
    recv_counts: list[int]
    out_rows: int

    def run(self, x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
        received = groups.all_to_all(x[self.send_index], self.send_counts, self.recv_counts)
        out = x.new_zeros(self.out_rows, *x.shape[1:])  # rows nobody sends (padding) stay zero
        out[self.recv_index] = received
        return out


def build_exchange(
    needs: list[torch.Tensor], holder: torch.Tensor, position: torch.Tensor, me: int, out_rows: int, device
) -> RowExchange:
    """needs[d]: the global rows rank d needs, in its target order (row j goes to target row j);
    holder[g] / position[g]: the rank that holds global row g and where in its source layout."""
    send, send_counts = [], []
    for need in needs:
        mine = need[holder[need] == me]
        send.append(position[mine])
        send_counts.append(int(mine.numel()))
    recv, recv_counts = [], []
    for src in range(len(needs)):
        at = torch.nonzero(holder[needs[me]] == src).flatten()
        recv.append(at)
        recv_counts.append(int(at.numel()))
    return RowExchange(
        send_index=torch.cat(send).to(device),
        send_counts=send_counts,
        recv_index=torch.cat(recv).to(device),
        recv_counts=recv_counts,
        out_rows=out_rows,
    )


@dataclass(frozen=True)
class SegmentPlan:
    """Every rank's segments of one step (global rows), this rank's layout, and the two exchanges."""

    rank: int
    bounds: list[list[tuple[int, int]]]  # [seq][rank] -> [lo, hi) global rows
    seqs: list[int]  # the sequence of each of this rank's (non-empty) segments
    seg_qsl: list[int]  # row starts of this rank's segments in its segment layout, halo rows included
    seg_halo: list[int]  # halo rows at the start of each of its segments
    core: torch.Tensor  # segment-layout rows that are not halo (device)
    last_owner: list[int]  # per sequence: the rank whose segment ends it (it holds the final conv window)
    to_segments: RowExchange  # row layout (the rank's PCP rows) -> segment layout, halo included
    to_rows: RowExchange  # segment layout (core rows) -> row layout


def _layout(bounds: list[list[tuple[int, int]]], qsl: list[int], rank: int) -> tuple[list, list, list, list]:
    seqs, seg_qsl, seg_halo, rows = [], [0], [], []
    for i, b in enumerate(bounds):
        lo, hi = b[rank]
        if lo >= hi:
            continue
        start = max(qsl[i], lo - HALO)
        seqs.append(i)
        seg_qsl.append(seg_qsl[-1] + hi - start)
        seg_halo.append(lo - start)
        rows.append(torch.arange(start, hi))
    return seqs, seg_qsl, seg_halo, rows


def plan_segments(full: ForwardBatch, size: int, me: int, local_rows: int, device: torch.device) -> SegmentPlan:
    qsl, t = full.query_start_loc, full.num_tokens
    bounds = [
        [(qsl[i] + lo, qsl[i] + hi) for lo, hi in segment_bounds(full.q_len(i), size)] for i in range(full.num_seqs)
    ]
    layouts = [_layout(bounds, qsl, r) for r in range(size)]
    seg_rows = [torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64) for *_, rows in layouts]

    # core rows: who runs them and where they sit in that rank's segment layout
    seg_owner = torch.full((t,), -1, dtype=torch.int64)
    seg_pos = torch.full((t,), -1, dtype=torch.int64)
    for r, (_, sq, halo, _) in enumerate(layouts):
        for j in range(len(halo)):
            core_at = torch.arange(sq[j] + halo[j], sq[j + 1])
            seg_owner[seg_rows[r][core_at]] = r
            seg_pos[seg_rows[r][core_at]] = core_at
    g = torch.arange(t)
    row_owner, row_pos = g % size, g // size
    real_rows = [g[r::size] for r in range(size)]

    seqs, sq, halo, _ = layouts[me]
    core = [torch.arange(sq[j] + halo[j], sq[j + 1]) for j in range(len(halo))]
    return SegmentPlan(
        rank=me,
        bounds=bounds,
        seqs=seqs,
        seg_qsl=sq,
        seg_halo=halo,
        core=(torch.cat(core) if core else torch.zeros(0, dtype=torch.int64)).to(device),
        last_owner=[max(r for r in range(size) if b[r][0] < b[r][1]) for b in bounds],
        to_segments=build_exchange(seg_rows, row_owner, row_pos, me, int(seg_rows[me].numel()), device),
        to_rows=build_exchange(real_rows, seg_owner, seg_pos, me, local_rows, device),
    )


@dataclass
class SegmentBatch(ForwardBatch):
    """What the KDA mixer sees in the segment layout: one "sequence" per segment of this rank (halo rows
    included), each with its own scratch conv slot (``state_slots`` index the scratch windows); ``full``
    and ``plan`` describe the step."""

    full: ForwardBatch | None = None
    plan: SegmentPlan | None = None
    groups: ParallelGroups | None = None


def segment_batch(full: ForwardBatch, plan: SegmentPlan, groups: ParallelGroups, device: torch.device) -> SegmentBatch:
    n, rows = len(plan.seqs), plan.seg_qsl[-1]
    lens = [plan.seg_qsl[j + 1] - plan.seg_qsl[j] for j in range(n)]
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return SegmentBatch(
        input_ids=torch.zeros(rows, dtype=torch.int64, device=device),
        positions=torch.zeros(rows, dtype=torch.int64, device=device),
        query_start_loc=list(plan.seg_qsl),
        context_lens=lens,  # each segment as a fresh sequence: the conv reads only its window
        block_tables=[empty] * n,
        slot_mapping=empty,
        state_slots=list(range(n)),
        # only a segment without halo starts its sequence (rank 0's): the real window, copied into scratch
        has_initial_state=[full.has_initial_state[i] and plan.seg_halo[j] == 0 for j, i in enumerate(plan.seqs)],
        logits_indices=empty,
        full=full,
        plan=plan,
        groups=groups,
    )
