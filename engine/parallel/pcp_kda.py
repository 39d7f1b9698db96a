"""KDA under prefill context parallelism: short conv over the gathered rows, the recurrence by a state scan.

Each rank projects its own (striped) rows. The conv inputs are all-gathered and every rank runs the short
conv over all rows (it is cheap, and every rank keeps a bit-identical conv window). The recurrence inputs
are all-gathered too; each rank then runs the recurrence on one contiguous, chunk-aligned segment of every
sequence (engine/parallel/kda_scan.py), the segments' linear parts are all-gathered and scanned, and an
all-to-all returns every rank the output rows it owns. Steps that are decode-only (nothing to split) and
chunks that write rung checkpoints (the state at each rung must exist) run the plain recurrence over all
rows on every rank instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.backends.base import KDABackend
from engine.forward_batch import ForwardBatch
from engine.parallel.kda_scan import ChunkFn, apply_initial_state, linear_segments, scan_states, segment_bounds
from engine.parallel.pcp import PCPForwardBatch, PCPRows
from kernels.kda.naive import naive_chunk_kda_varlen


@dataclass(frozen=True)
class ScanPlan:
    """Where every rank's segments lie (global rows) and how the outputs go back to the row owners."""

    bounds: list[list[tuple[int, int]]]  # [seq][rank] -> [lo, hi) global rows
    mine: list[tuple[int, int, int]]  # (seq, lo, hi) of this rank's non-empty segments
    seg_rows: torch.Tensor  # global rows of this rank's segments, in order (device)
    send_order: torch.Tensor  # seg_rows reordered by owner rank (stable)
    send_counts: list[int]
    recv_counts: list[int]
    recv_local: torch.Tensor  # local row of each received output row, in arrival order (device)


def plan_scan(full: ForwardBatch, rows: PCPRows) -> ScanPlan:
    size, me = rows.size, rows.rank
    qsl = full.query_start_loc
    bounds = [
        [(qsl[i] + lo, qsl[i] + hi) for lo, hi in segment_bounds(qsl[i + 1] - qsl[i], size)]
        for i in range(full.num_seqs)
    ]

    def segment_rows(rank: int) -> torch.Tensor:
        parts = [torch.arange(b[rank][0], b[rank][1]) for b in bounds]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    own = segment_rows(me)
    owner = own % size
    received = [r[r % size == me] for r in (segment_rows(s) for s in range(size))]
    device = rows.groups.device
    return ScanPlan(
        bounds=bounds,
        mine=[(i, b[me][0], b[me][1]) for i, b in enumerate(bounds) if b[me][0] < b[me][1]],
        seg_rows=own.to(device),
        send_order=torch.argsort(owner, stable=True).to(device),
        send_counts=torch.bincount(owner, minlength=size).tolist(),
        recv_counts=[int(r.numel()) for r in received],
        recv_local=(torch.cat(received) // size).to(device),
    )


class PCPKDABackend(KDABackend):
    def __init__(self, inner: KDABackend) -> None:
        self.inner = inner
        # the inner backend's chunk kernel (fla's chunk_kda on the GPU); the reference chunk form otherwise
        self.chunk_fn: ChunkFn = getattr(inner, "chunk_fn", None) or naive_chunk_kda_varlen
        self._plan: tuple[ForwardBatch, ScanPlan] | None = None

    def short_conv(
        self, x: torch.Tensor, conv_cache: torch.Tensor, weight: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        assert isinstance(batch, PCPForwardBatch) and batch.rows is not None and batch.full is not None
        out = self.inner.short_conv(batch.rows.gather(x), conv_cache, weight, batch.full)
        own = batch.rows.own(out)
        batch.stash["conv_out"], batch.stash["conv_own"] = out, own  # q|k|v of every row, for the recurrence
        return own

    def recurrence(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        assert isinstance(batch, PCPForwardBatch) and batch.rows is not None and batch.full is not None
        rows, t, h = batch.rows, batch.full.num_tokens, q.shape[1]
        conv, own = batch.stash.pop("conv_out", None), batch.stash.pop("conv_own", None)
        # Reuse the gathered conv output when q, k, v are views of what short_conv returned (the KDA layer
        # splits it). A structural test, the same on every rank: a data-dependent one could send one rank
        # into the fallback gather alone, and the collectives would no longer pair up.
        if own is None or any(z.untyped_storage().data_ptr() != own.untyped_storage().data_ptr() for z in (q, k, v)):
            conv = rows.gather(torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=-1))
        qg, kg, vg = (z.reshape(t, h, -1) for z in conv.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=-1))
        # g is fp32 and beta the activation dtype; fp32 carries both exactly, in one gather
        gb = rows.gather(torch.cat([g.flatten(1), beta.float()], dim=-1))
        gg, bg = gb[:, : g[0].numel()].reshape(t, *g.shape[1:]), gb[:, g[0].numel() :].to(beta.dtype)
        full = batch.full
        if full.is_decode_only or any(full.checkpoints):
            # one token a sequence: nothing to split; rungs: their states come from the plain recurrence
            return rows.own(self.inner.recurrence(qg, kg, vg, gg, bg, state_cache, full))
        return self._scan(qg, kg, vg, gg, bg, state_cache, full, rows)

    def _scan_plan(self, full: ForwardBatch, rows: PCPRows) -> ScanPlan:
        if self._plan is None or self._plan[0] is not full:  # once per step, shared by every KDA layer
            self._plan = (full, plan_scan(full, rows))
        return self._plan[1]

    def _scan(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state_cache: torch.Tensor,
        full: ForwardBatch,
        rows: PCPRows,
    ) -> torch.Tensor:
        """This rank's segments -> the scan of every rank's (M, N) -> this rank's output rows [local, H, V]."""
        plan = self._scan_plan(full, rows)
        me, h, kd, vd = rows.rank, k.shape[1], k.shape[2], v.shape[2]
        trans_final = q.new_zeros(full.num_seqs, h, kd, kd + vd, dtype=torch.float32)
        trans_final[..., :kd] = torch.eye(kd, device=q.device)  # an empty segment passes the state on unchanged
        out = None
        if plan.mine:
            sel = [x[plan.seg_rows] for x in (q, k, v, g, beta)]
            cu = [0]
            for _, lo, hi in plan.mine:
                cu.append(cu[-1] + hi - lo)
            if me == 0:  # the first segment starts from the true initial state: no linear parts needed
                init = torch.stack([self._initial(state_cache, full, i, h, kd, vd) for i, _, _ in plan.mine])
                out, final, _ = self.chunk_fn(*sel, init, cu)
                for j, (i, _, _) in enumerate(plan.mine):
                    trans_final[i, ..., :kd] = 0.0
                    trans_final[i, ..., kd:] = final[j]
            else:
                o0, p, trans, final0 = linear_segments(self.chunk_fn, *sel, cu)
                for j, (i, _, _) in enumerate(plan.mine):
                    trans_final[i] = torch.cat([trans[j], final0[j]], dim=-1)
        every = rows.groups.all_gather(trans_final)  # [pcp, seqs, H, K, K + V]
        starts = {}
        for i, slot in enumerate(full.state_slots):
            init = self._initial(state_cache, full, i, h, kd, vd)
            states = scan_states(init, every[:, i, ..., :kd], every[:, i, ..., kd:])
            state_cache[slot] = states[-1].to(state_cache.dtype)
            starts[i] = states[me]
        if plan.mine and me != 0:
            out = torch.cat(
                [
                    apply_initial_state(o0[c0:c1], p[c0:c1], starts[i])
                    for (i, _, _), c0, c1 in zip(plan.mine, cu[:-1], cu[1:], strict=True)
                ]
            )
        if out is None:
            out = q.new_zeros(0, h, vd, dtype=torch.float32)
        # every output row to the rank that owns it
        received = rows.groups.all_to_all(out.float()[plan.send_order], plan.send_counts, plan.recv_counts)
        local = q.new_zeros(rows.local_rows, h, vd, dtype=torch.float32)
        local[plan.recv_local] = received
        return local

    @staticmethod
    def _initial(state_cache: torch.Tensor, full: ForwardBatch, i: int, h: int, kd: int, vd: int) -> torch.Tensor:
        if full.has_initial_state[i]:
            return state_cache[full.state_slots[i]].float()
        return torch.zeros(h, kd, vd, dtype=torch.float32, device=state_cache.device)
