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
from kernels.upload import upload

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


def _residue(a: int, b: int, residue: int, size: int) -> tuple[int, int]:
    """(first row, count) of the rows g in [a, b) with g % size == residue: one rank's share of a range."""
    g0 = a + (residue - a) % size
    return g0, max(0, -(-(b - g0) // size))


def _exchange(parts_send: list[list[torch.Tensor]], parts_recv: list[list[torch.Tensor]], out_rows: int, device):
    send_counts = [sum(int(x.numel()) for x in ps) for ps in parts_send]
    recv_counts = [sum(int(x.numel()) for x in ps) for ps in parts_recv]
    flat = [x for ps in parts_send for x in ps] + [x for ps in parts_recv for x in ps]
    index = upload(torch.cat(flat) if flat else torch.zeros(0, dtype=torch.int64), device)  # one host->device copy
    n = sum(send_counts)
    return RowExchange(index[:n], send_counts, index[n:], recv_counts, out_rows)


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


@dataclass(frozen=True)
class _Chunk:
    """One segment of one rank, in that rank's segment layout."""

    seq: int
    start: int  # first global row, halo included
    lo: int  # first core row
    hi: int
    off: int  # where ``start`` sits in the segment layout


def _chunks(bounds: list[list[tuple[int, int]]], qsl: list[int], rank: int) -> list[_Chunk]:
    out, off = [], 0
    for i, b in enumerate(bounds):
        lo, hi = b[rank]
        if lo < hi:
            start = max(qsl[i], lo - HALO)
            out.append(_Chunk(i, start, lo, hi, off))
            off += hi - start
    return out


def plan_segments(full: ForwardBatch, size: int, me: int, local_rows: int, device: torch.device) -> SegmentPlan:
    """All index arithmetic on the host from the ranges alone (no per-row tables: a 64k-token step plans in
    well under a millisecond), moved to the device in one copy per exchange."""
    qsl = full.query_start_loc
    bounds = [
        [(qsl[i] + lo, qsl[i] + hi) for lo, hi in segment_bounds(full.q_len(i), size)] for i in range(full.num_seqs)
    ]
    chunks = [_chunks(bounds, qsl, r) for r in range(size)]
    mine = chunks[me]

    # row layout (row g at local row g // size of rank g % size) -> segment layouts, halo rows included
    send = [
        [torch.arange(g0 // size, g0 // size + n) for g0, n in (_residue(c.start, c.hi, me, size) for c in chunks[d])]
        for d in range(size)
    ]
    recv = [
        [
            torch.arange(n) * size + (c.off + g0 - c.start)
            for c in mine
            for g0, n in [_residue(c.start, c.hi, src, size)]
        ]
        for src in range(size)
    ]
    seg_rows = mine[-1].off + mine[-1].hi - mine[-1].start if mine else 0
    to_segments = _exchange(send, recv, seg_rows, device)

    # core rows of the segment layouts -> the row layout
    send = [
        [torch.arange(n) * size + (c.off + g0 - c.start) for c in mine for g0, n in [_residue(c.lo, c.hi, d, size)]]
        for d in range(size)
    ]
    recv = [
        [torch.arange(g0 // size, g0 // size + n) for g0, n in (_residue(c.lo, c.hi, me, size) for c in chunks[src])]
        for src in range(size)
    ]
    to_rows = _exchange(send, recv, local_rows, device)

    core = [torch.arange(c.off + c.lo - c.start, c.off + c.hi - c.start) for c in mine]
    seg_qsl = [c.off for c in mine] + [seg_rows]
    return SegmentPlan(
        rank=me,
        bounds=bounds,
        seqs=[c.seq for c in mine],
        seg_qsl=seg_qsl,
        seg_halo=[c.lo - c.start for c in mine],
        core=upload(torch.cat(core) if core else torch.zeros(0, dtype=torch.int64), device),
        last_owner=[max(r for r in range(size) if b[r][0] < b[r][1]) for b in bounds],
        to_segments=to_segments,
        to_rows=to_rows,
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
