"""KDA under prefill context parallelism.

Prefill chunks: the mixer runs in the segment layout (engine/parallel/pcp_segments.py): its input rows
move to the rank that runs their segment, that rank runs the short conv over its segments (halo rows give
the window) and the recurrence by the state scan (engine/parallel/kda_scan.py), and the output rows move
back. Every rank ends with the same conv window and recurrent state of every sequence: the windows come
from the rank whose segment ends the sequence, the states from the scan, which every rank runs alike.

Decode-only steps (one token a sequence: nothing to split) and chunks that write rung checkpoints (the
state at each rung must exist on every rank) run in the row layout: the conv inputs and the recurrence
inputs are all-gathered and every rank runs the plain backend over all rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import record_function

from engine.backends.base import KDABackend
from engine.backends.per_step import PerStep
from engine.forward_batch import ForwardBatch
from engine.parallel.kda_scan import ChunkFn, apply_initial_state, linear_segments, scan_states
from engine.parallel.pcp import PCPForwardBatch
from engine.parallel.pcp_segments import HALO, SegmentBatch, plan_segments, segment_batch
from kernels.kda.naive import naive_chunk_kda_varlen


class PCPKDABackend(KDABackend):
    def __init__(self, inner: KDABackend) -> None:
        self.inner = inner
        # the inner backend's chunk kernel (fla's chunk_kda on the GPU); the reference chunk form otherwise
        self.chunk_fn: ChunkFn = getattr(inner, "chunk_fn", None) or naive_chunk_kda_varlen
        self._step = PerStep()

    def gate(self, g_raw: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, head_dim: int) -> torch.Tensor:
        return self.inner.gate(g_raw, a_log, dt_bias, head_dim)  # row-wise: any layout

    # ---- layout -------------------------------------------------------------------------------------------
    def run_mixer(
        self, mixer: Callable[[torch.Tensor, ForwardBatch], torch.Tensor], x: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        assert isinstance(batch, PCPForwardBatch) and batch.rows is not None and batch.full is not None
        full, groups = batch.full, batch.rows.groups
        if full.is_decode_only or any(full.checkpoints):
            return mixer(x, batch)  # the row layout
        rows = batch.rows

        def plan() -> SegmentBatch:  # once per step, for every KDA layer
            with record_function("pcp.plan_segments"):
                p = plan_segments(full, rows.size, rows.rank, rows.local_rows, x.device)
                return segment_batch(full, p, groups, x.device)

        seg = self._step.get(full, "segments", plan)
        assert seg.plan is not None
        with record_function("pcp.to_segments"):
            xs = seg.plan.to_segments.run(x, groups)
        with record_function("pcp.kda_mixer"):
            y = mixer(xs, seg)
        with record_function("pcp.to_rows"):
            return seg.plan.to_rows.run(y, groups)

    # ---- short conv -----------------------------------------------------------------------------------------
    def short_conv(
        self, x: torch.Tensor, conv_cache: torch.Tensor, weight: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        if isinstance(batch, SegmentBatch):
            with record_function("pcp.segment_conv"):
                return self._segment_conv(x, conv_cache, weight, batch)
        assert isinstance(batch, PCPForwardBatch) and batch.rows is not None and batch.full is not None
        out = self.inner.short_conv(batch.rows.gather(x), conv_cache, weight, batch.full)
        own = batch.rows.own(out)
        batch.stash["conv_out"], batch.stash["conv_own"] = out, own  # q|k|v of every row, for the recurrence
        return own

    def _segment_conv(
        self, x: torch.Tensor, conv_cache: torch.Tensor, weight: torch.Tensor, seg: SegmentBatch
    ) -> torch.Tensor:
        plan, full = seg.plan, seg.full
        assert plan is not None and full is not None and seg.groups is not None
        if weight.shape[1] - 1 > HALO:
            raise ValueError(f"PCP: a short conv of kernel size {weight.shape[1]} needs more than {HALO} halo rows")
        scratch = conv_cache.new_zeros(len(plan.seqs), *conv_cache.shape[1:])
        for j, i in enumerate(plan.seqs):
            if seg.has_initial_state[j]:
                scratch[j] = conv_cache[full.state_slots[i]]
        out = self.inner.short_conv(x, scratch, weight, seg) if plan.seqs else x
        # every rank keeps the window of the rank whose segment ends the sequence
        ends = conv_cache.new_zeros(full.num_seqs, *conv_cache.shape[1:])
        for j, i in enumerate(plan.seqs):
            if plan.last_owner[i] == plan.rank:
                ends[i] = scratch[j]
        every = seg.groups.all_gather(ends)  # [pcp, seqs, C, W-1]
        for i, slot in enumerate(full.state_slots):
            conv_cache[slot] = every[plan.last_owner[i], i]
        return out

    # ---- recurrence ---------------------------------------------------------------------------------------
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
        if isinstance(batch, SegmentBatch):
            with record_function("pcp.kda_scan"):
                return self._scan(q, k, v, g, beta, state_cache, batch)
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
        return rows.own(self.inner.recurrence(qg, kg, vg, gg, bg, state_cache, batch.full))

    def _scan(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state_cache: torch.Tensor,
        seg: SegmentBatch,
    ) -> torch.Tensor:
        """This rank's segments (halo rows dropped) -> the scan of every rank's (M, N) -> outputs [rows, H, V]."""
        plan, full = seg.plan, seg.full
        assert plan is not None and full is not None and seg.groups is not None
        me, h, kd, vd = plan.rank, k.shape[1], k.shape[2], v.shape[2]
        trans_final = q.new_zeros(full.num_seqs, h, kd, kd + vd, dtype=torch.float32)
        trans_final[..., :kd] = torch.eye(kd, device=q.device)  # an empty segment passes the state on unchanged
        cu = [0]
        for j in range(len(plan.seqs)):
            cu.append(cu[-1] + plan.seg_qsl[j + 1] - plan.seg_qsl[j] - plan.seg_halo[j])
        out = q.new_zeros(q.shape[0], h, vd, dtype=torch.float32)
        o0 = p = None
        if plan.seqs:
            sel = [z[plan.core] for z in (q, k, v, g, beta)]
            if me == 0:  # the first segment starts from the true initial state: no linear parts needed
                init = torch.stack([_initial(state_cache, full, i, h, kd, vd) for i in plan.seqs])
                o0, final, _ = self.chunk_fn(*sel, init, cu)
                for j, i in enumerate(plan.seqs):
                    trans_final[i, ..., :kd] = 0.0
                    trans_final[i, ..., kd:] = final[j]
            else:
                o0, p, trans, final0 = linear_segments(self.chunk_fn, *sel, cu)
                for j, i in enumerate(plan.seqs):
                    trans_final[i] = torch.cat([trans[j], final0[j]], dim=-1)
        every = seg.groups.all_gather(trans_final)  # [pcp, seqs, H, K, K + V]
        starts = {}
        for i, slot in enumerate(full.state_slots):
            init = _initial(state_cache, full, i, h, kd, vd)
            states = scan_states(init, every[:, i, ..., :kd], every[:, i, ..., kd:])
            state_cache[slot] = states[-1].to(state_cache.dtype)
            starts[i] = states[me]
        if o0 is not None:
            if p is None:
                out[plan.core] = o0.float()
            else:
                out[plan.core] = torch.cat(
                    [
                        apply_initial_state(o0[c0:c1], p[c0:c1], starts[i])
                        for i, c0, c1 in zip(plan.seqs, cu[:-1], cu[1:], strict=True)
                    ]
                )
        return out


def _initial(state_cache: torch.Tensor, full: ForwardBatch, i: int, h: int, kd: int, vd: int) -> torch.Tensor:
    if full.has_initial_state[i]:
        return state_cache[full.state_slots[i]].float()
    return torch.zeros(h, kd, vd, dtype=torch.float32, device=state_cache.device)
