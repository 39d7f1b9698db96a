"""Prefill context parallelism: a (micro)batch's token rows striped round-robin over the pcp ranks.

    global row g  ->  rank g % pcp, local row g // pcp        rows T .. T_pad-1 are padding

Row-wise work (projections, MLPs, MoE: each rank runs its own rows) needs nothing. What crosses rows:

- attention: each rank's KV entries (the MLA latent, or GQA K|V) are all-gathered and every rank
  writes all of them, so each rank's page cache is complete and its query rows see the whole causal
  prefix, earlier chunks and prefix-cache hits included. The latent is gathered, not the expanded K/V:
  kv_lora_rank + rope values a token instead of heads x (nope + rope + v).
- KDA: the recurrence runs along the sequence. Each rank projects its own rows; the recurrence inputs
  are gathered and every rank runs short conv + recurrence over all rows (redundantly, bit-identically),
  keeps its own rows of the output and a full copy of the state. See docs/PARALLEL.md for why this and
  not a cross-rank state scan.

Padding rows: input id 0 at position 0; they are in no sequence, so they read no key, their KV and KDA
inputs are dropped by the gather (only rows < T are kept) and their outputs are never selected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from engine.backends.base import AttentionBackend, KDABackend, MLADims
from engine.forward_batch import ForwardBatch
from engine.parallel.groups import ParallelGroups
from engine.parallel.kda_scan import apply_initial_state, scan_states, segment_kda
from kernels.paged_attention.naive import gather_pages

SCAN_CHUNK = 64  # KDA's chunk: segments start on chunk boundaries, so no rank pads a chunk it shares

AttendFn = Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]
"""(query rows, their positions, sequence index, context length) -> attention output rows."""


class PCPRows:
    """Which rows of a batch of ``num_rows`` this rank holds."""

    def __init__(self, groups: ParallelGroups, num_rows: int) -> None:
        self.groups = groups
        self.size = groups.inner_size
        self.rank = groups.inner_rank
        self.num_rows = num_rows
        self.local_rows = -(-num_rows // self.size)
        self.index = torch.arange(self.local_rows, device=groups.device) * self.size + self.rank
        """Global row of each local row (>= num_rows: padding)."""

    def own(self, x: torch.Tensor) -> torch.Tensor:
        """Global rows [T, ...] -> this rank's rows [local_rows, ...] (padding rows are zeros)."""
        pad = self.local_rows * self.size - self.num_rows
        if pad:
            x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
        return x[self.rank :: self.size]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's rows [local_rows, ...] -> the global rows [T, ...], padding dropped."""
        parts = self.groups.all_gather(x)  # [pcp, local_rows, ...]
        return parts.transpose(0, 1).reshape(-1, *x.shape[1:])[: self.num_rows]

    def seq_rows(self, start: int, end: int, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(local rows, their positions) of the sequence owning global rows [start, end)."""
        local = torch.nonzero((self.index >= start) & (self.index < end)).flatten()
        return local, context_len - (end - start) + (self.index[local] - start)


@dataclass
class PCPForwardBatch(ForwardBatch):
    """The model's view on a PCP rank: input_ids / positions are this rank's rows; every other field
    describes the whole batch (``full``), which the PCP backends and the layer hooks use."""

    full: ForwardBatch | None = None
    rows: PCPRows | None = None
    stash: dict[str, torch.Tensor] = field(default_factory=dict)


def localize(batch: ForwardBatch, groups: ParallelGroups) -> PCPForwardBatch:
    rows = PCPRows(groups, batch.num_tokens)
    base = {f.name: getattr(batch, f.name) for f in fields(ForwardBatch)}
    base["input_ids"] = rows.own(batch.input_ids)
    base["positions"] = rows.own(batch.positions)
    return PCPForwardBatch(**base, full=batch, rows=rows)


def attention_at(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """causal_attention for queries at arbitrary positions q_pos [Tq] over keys 0..Tk-1. fp32 softmax."""
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.arange(k.shape[0], device=q.device)[None, :] > q_pos[:, None]
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")).float(), dim=-1).to(v.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)


class PCPAttentionBackend(AttentionBackend):
    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner

    def write_kv(self, cache: torch.Tensor, batch: ForwardBatch, entries: torch.Tensor) -> None:
        assert isinstance(batch, PCPForwardBatch) and batch.rows is not None and batch.full is not None
        self.inner.write_kv(cache, batch.full, batch.rows.gather(entries))

    @staticmethod
    def _per_seq(q: torch.Tensor, batch: ForwardBatch, attend: AttendFn, out_dim: int) -> torch.Tensor:
        """Attention of this rank's query rows, sequence by sequence; padding rows stay zero."""
        assert isinstance(batch, PCPForwardBatch) and batch.rows is not None and batch.full is not None
        full, rows = batch.full, batch.rows
        out = q.new_zeros(q.shape[0], q.shape[1], out_dim)
        for i, ctx in enumerate(full.context_lens):
            local, pos = rows.seq_rows(full.query_start_loc[i], full.query_start_loc[i + 1], ctx)
            if local.numel():
                out[local] = attend(q[local], pos, i, ctx)
        return out

    def gqa(self, q: torch.Tensor, cache: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
        n_rep = q.shape[1] // cache.shape[3]

        def attend(qs: torch.Tensor, pos: torch.Tensor, i: int, ctx: int) -> torch.Tensor:
            kv = gather_pages(cache, batch.block_tables[i], ctx)
            k, v = (kv[:, j].repeat_interleave(n_rep, dim=1) for j in (0, 1))
            return attention_at(qs, k, v, pos, scale)

        return self._per_seq(q, batch, attend, q.shape[2])

    def mla(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        batch: ForwardBatch,
        kv_b_weight: torch.Tensor,
        dims: MLADims,
        scale: float,
    ) -> torch.Tensor:
        h = q.shape[1]

        def attend(qs: torch.Tensor, pos: torch.Tensor, i: int, ctx: int) -> torch.Tensor:
            lat = gather_pages(cache, batch.block_tables[i], ctx)
            c_kv, k_pe = lat[:, : dims.kv_lora_rank], lat[:, dims.kv_lora_rank :]
            kv = torch.nn.functional.linear(c_kv, kv_b_weight).view(ctx, h, dims.qk_nope_head_dim + dims.v_head_dim)
            k_nope, v = kv.split([dims.qk_nope_head_dim, dims.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_pe[:, None, :].expand(ctx, h, k_pe.shape[-1])], dim=-1)
            return attention_at(qs, k, v, pos, scale)

        return self._per_seq(q, batch, attend, dims.v_head_dim)


class PCPKDABackend(KDABackend):
    """Gather the recurrence inputs, run conv + recurrence over all rows, keep this rank's rows."""

    def __init__(self, inner: KDABackend) -> None:
        self.inner = inner

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
        return rows.own(self._scan(qg, kg, vg, gg, bg, state_cache, full, rows))

    @staticmethod
    def _scan(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state_cache: torch.Tensor,
        full: ForwardBatch,
        rows: PCPRows,
    ) -> torch.Tensor:
        """Each rank runs its contiguous, chunk-aligned segment of every sequence from a zero state; the
        segments' (M, N) are all-gathered and scanned identically on every rank (engine/parallel/kda_scan.py)."""
        size, me = rows.size, rows.rank
        h, kd, vd = k.shape[1], k.shape[2], v.shape[2]
        eye = torch.eye(kd, device=q.device).expand(h, kd, kd)
        trans_final = q.new_zeros(full.num_seqs, h, kd, kd + vd, dtype=torch.float32)
        mine = []
        for i in range(full.num_seqs):
            s, e = full.query_start_loc[i], full.query_start_loc[i + 1]
            seg = -(-(e - s) // size)
            seg = -(-seg // SCAN_CHUNK) * SCAN_CHUNK
            lo, hi = min(s + me * seg, e), min(s + (me + 1) * seg, e)
            trans_final[i, ..., :kd] = eye  # an empty segment passes the state on unchanged
            if lo < hi:
                o0, p, trans, final0 = segment_kda(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi])
                trans_final[i] = torch.cat([trans, final0], dim=-1)
                mine.append((i, lo, hi, o0, p))
        every = rows.groups.all_gather(trans_final)  # [pcp, seqs, H, K, K + V]
        starts = []
        for i, slot in enumerate(full.state_slots):
            init = state_cache[slot] if full.has_initial_state[i] else state_cache.new_zeros(h, kd, vd)
            states = scan_states(init.float(), every[:, i, ..., :kd], every[:, i, ..., kd:])
            state_cache[slot] = states[-1]
            starts.append(states[me])
        out = q.new_zeros(q.shape[0], h, vd, dtype=torch.float32)
        for i, lo, hi, o0, p in mine:
            out[lo:hi] = apply_initial_state(o0, p, starts[i])
        return rows.groups.all_reduce(out)  # every row was computed on one rank (zeros elsewhere): exact
