"""The GPU KDA backend's per-step bookkeeping, built once a step and shared by every KDA layer: state slots and
query offsets on the device, the decode rows, and the prefill chunks cut into chunk_kda rounds at the prefix
cache's rungs (checkpoint copies from chunk_kda's intermediate states where a rung falls on a chunk boundary)."""

from __future__ import annotations

import numpy as np
import torch

from engine.forward_batch import ForwardBatch
from kernels.kda.fla_adapter import KDA_CHUNK, chunk_layout
from kernels.upload import Upload, upload


def q_lens_of(batch: ForwardBatch) -> list[int]:
    return [batch.q_len(i) for i in range(batch.num_seqs)]


class _Round:
    """One chunk_kda launch: one segment of each of some sequences (segments of a sequence run in order)."""

    def __init__(self) -> None:
        self.rows: list[range] = []  # token rows of the segments, in order
        self.slots: list[int] = []
        self.cu: list[int] = [0]
        self.copies: list[tuple[str, int, int]] = []  # ("final", seg index, dst) | ("h", chunk index, dst)
        self.num_chunks = 0  # chunk_kda's chunk count so far (each segment starts a new chunk)

    def add(self, rows: range, slot: int, cks: list[tuple[int, int]]) -> None:
        """Add a segment; cks are (offset into the segment, dst slot), 0 < offset <= len, offset % 64 == 0
        unless it is the segment's end."""
        seg = len(self.slots)
        for off, dst in cks:
            if off == len(rows):
                self.copies.append(("final", seg, dst))
            else:
                self.copies.append(("h", self.num_chunks + off // KDA_CHUNK, dst))
        self.rows.append(rows)
        self.slots.append(slot)
        self.cu.append(self.cu[-1] + len(rows))
        self.num_chunks += -(-len(rows) // KDA_CHUNK)

    @property
    def needs_h(self) -> bool:
        return any(kind == "h" for kind, _, _ in self.copies)

    def row_tensor(self) -> torch.Tensor:
        """The segments' rows as one int64 tensor, built by numpy: ``torch.tensor`` of an 8k-element list took
        ~0.4 ms of the step's host time before its first kernel."""
        parts = [np.arange(r.start, r.stop, dtype=np.int64) for r in self.rows]
        return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))


class KDAStep:
    """Slot bookkeeping of one step for the KDA layers (built once, shared by all KDA layers)."""

    def __init__(self, batch: ForwardBatch, device: torch.device, exact_checkpoints: bool, up: Upload = upload) -> None:
        n = batch.num_seqs
        q_lens = q_lens_of(batch)
        slots, qsl = batch.state_slots, batch.query_start_loc
        cks_all = batch.checkpoints if batch.checkpoints else [()] * n
        ints = slots + qsl + [int(b) for b in batch.has_initial_state]
        dev = up(torch.tensor(ints, dtype=torch.int32), device)
        self.slots, self.qsl, self.has_init = dev[:n], dev[n : 2 * n + 1], dev[2 * n + 1 :]
        self.max_q_len = max(q_lens, default=0)
        fresh = [s for s, init in zip(slots, batch.has_initial_state, strict=True) if not init]
        self.fresh = up(torch.tensor(fresh, dtype=torch.int64), device) if fresh else None

        # conv checkpoints: (row start, tokens of the chunk before the rung, slot, has_init, dst)
        self.conv_cks = [
            (qsl[i], pos - (batch.context_lens[i] - q_lens[i]), slots[i], batch.has_initial_state[i], dst)
            for i in range(n)
            for pos, dst in cks_all[i]
        ]
        dec = [i for i in range(n) if q_lens[i] == 1]
        pre = [i for i in range(n) if q_lens[i] != 1]
        self.all_decode = not pre
        self.dec_slots = self.dec_rows = None
        self.dec_copies = [(slots[i], dst) for i in dec for _, dst in cks_all[i]]  # a one-token chunk's rung is its end
        if dec:
            self.dec_slots = up(torch.tensor([slots[i] for i in dec], dtype=torch.int64), device)
            if pre:
                self.dec_rows = up(torch.tensor([qsl[i] for i in dec], dtype=torch.int64), device)

        # prefill: cut each chunk into segments at rungs that chunk_kda's intermediate states cannot give
        # (not a multiple of 64 tokens into the current segment, or every rung when exact_checkpoints);
        # segment j of every sequence goes into round j.
        rounds: list[_Round] = []
        self.pre_copies: list[tuple[int, int]] = []  # (slot, dst): rung at the chunk start (initial state)
        for i in pre:
            start = batch.context_lens[i] - q_lens[i]
            seg_start, seg_cks, segs = 0, [], []
            for pos, dst in sorted(cks_all[i]):
                off = pos - start
                if off == seg_start:
                    if not segs:
                        self.pre_copies.append((slots[i], dst))
                    else:
                        segs[-1][1].append((segs[-1][0].stop - segs[-1][0].start, dst))
                    continue
                if exact_checkpoints or (off - seg_start) % KDA_CHUNK:
                    segs.append((range(qsl[i] + seg_start, qsl[i] + off), [*seg_cks, (off - seg_start, dst)]))
                    seg_start, seg_cks = off, []
                else:
                    seg_cks.append((off - seg_start, dst))
            if seg_start < q_lens[i] or not segs:
                segs.append((range(qsl[i] + seg_start, qsl[i] + q_lens[i]), seg_cks))
            for j, (rows, cks) in enumerate(segs):
                if j == len(rounds):
                    rounds.append(_Round())
                rounds[j].add(rows, slots[i], cks)
        self.rounds = [
            (
                up(r.row_tensor(), device),
                up(torch.tensor(r.slots, dtype=torch.int64), device),
                chunk_layout(r.cu, device, up),  # fla's chunk tables, once per step for every KDA layer
                r.copies,
                r.needs_h,
            )
            for r in rounds
        ]
        self.rows_are_all = len(rounds) == 1 and not dec  # round 0 covers every row in order
