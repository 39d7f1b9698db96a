"""Prefill context parallelism: a (micro)batch's token rows striped round-robin over the pcp ranks.

    global row g  ->  rank g % pcp, local row g // pcp        rows T .. T_pad-1 are padding

Row-wise work (projections, MLPs, MoE: each rank runs its own rows) needs nothing. What crosses rows:

- attention: each rank's KV entries (the MLA latent, or GQA K|V) are all-gathered and every rank
  writes all of them, so each rank's page cache is complete and its query rows see the whole causal
  prefix, earlier chunks and prefix-cache hits included. The latent is gathered, not the expanded K/V:
  kv_lora_rank + rope values a token instead of heads x (nope + rope + v).
  With the reference backend each rank attends its rows per sequence (``attention_at``); with the
  Triton backend one launch covers the batch, the kernel told each sequence's first local query position
  and the stride pcp (``local_queries``).
- KDA: the recurrence runs along the sequence: engine/parallel/pcp_kda.py (a state scan over contiguous
  segments, docs/PARALLEL.md).

Padding rows: input id 0 at position 0; they are in no sequence, so they read no key, their KV and KDA
inputs are dropped by the gather (only rows < T are kept) and their outputs are never selected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from engine.backends.base import AttentionBackend, MLADims
from engine.backends.per_step import PerStep
from engine.backends.torch_ref import TorchAttentionBackend
from engine.forward_batch import ForwardBatch
from engine.parallel.groups import ParallelGroups
from kernels.paged_attention.naive import gather_pages

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


@dataclass(frozen=True)
class LocalQueries:
    """This rank's query rows of a batch, per sequence: rows qsl[i]:qsl[i+1] (local) at positions
    pos0[i], pos0[i] + pcp, ... — the strided-position form of the Triton kernel's metadata."""

    qsl: list[int]
    pos0: list[int]

    @property
    def num_rows(self) -> int:
        return self.qsl[-1]  # local rows after these are padding


def local_queries(full: ForwardBatch, rows: PCPRows) -> LocalQueries:
    size, r = rows.size, rows.rank
    qsl, pos0 = [0], []
    for i, ctx in enumerate(full.context_lens):
        s, e = full.query_start_loc[i], full.query_start_loc[i + 1]
        first = (s - r + size - 1) // size  # first local row of the sequence: global row first * size + r >= s
        qsl.append((e - r + size - 1) // size)
        pos0.append(ctx - (e - s) + first * size + r - s)
    return LocalQueries(qsl, pos0)


class PCPAttentionBackend(AttentionBackend):
    """The reference backend's attention per sequence at the rows' positions (``attention_at``); a fast
    (Triton) backend's kernel with strided query positions, one launch for the whole batch."""

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.fast = not isinstance(inner, TorchAttentionBackend)
        self._step = PerStep()

    def _queries(self, batch: PCPForwardBatch) -> LocalQueries:
        return self._step.get(batch, "queries", lambda: local_queries(batch.full, batch.rows))

    def _fast_gqa(self, q: torch.Tensor, cache: torch.Tensor, batch: PCPForwardBatch, scale: float) -> torch.Tensor:
        from kernels.paged_attention.meta import plan_gqa
        from kernels.paged_attention.triton import attention_fwd

        full, rows = batch.full, batch.rows
        group, d = q.shape[1] // cache.shape[3], q.shape[-1]
        lq = self._queries(batch)
        meta = self._step.get(
            batch,
            "gqa",
            lambda: plan_gqa(
                lq.qsl,
                full.context_lens,
                self.inner.block_tables(full, q.device),
                group,
                q.device,
                d,
                q_pos0=lq.pos0,
                pos_stride=rows.size,
            ),
        )
        out, n = q.new_zeros(q.shape[0], q.shape[1], d), lq.num_rows
        attention_fwd(q[:n].contiguous(), cache[:, :, 0], cache[:, :, 1], meta, scale, out=out[:n])
        return out

    def _fast_mla(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        batch: PCPForwardBatch,
        kv_b_weight: torch.Tensor,
        dims: MLADims,
        scale: float,
    ) -> torch.Tensor:
        from kernels.paged_attention.mla import plan_mla, run_mla

        full, rows = batch.full, batch.rows
        lq = self._queries(batch)
        parts = self._step.get(
            batch,
            "mla",
            lambda: plan_mla(
                lq.qsl,
                full.context_lens,
                self.inner.block_tables(full, q.device),
                q.shape[1],
                cache.shape[1],
                dims.kv_lora_rank,
                q.device,
                self.inner.mla_expand_min_q_len,
                q_pos0=lq.pos0,
                pos_stride=rows.size,
            ),
        )
        out = q.new_zeros(q.shape[0], q.shape[1], dims.v_head_dim)
        out[: lq.num_rows] = run_mla(
            q[: lq.num_rows].contiguous(),
            cache,
            parts,
            kv_b_weight,
            dims.kv_lora_rank,
            dims.qk_nope_head_dim,
            dims.v_head_dim,
            scale,
        )
        return out

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
        if self.fast:
            assert isinstance(batch, PCPForwardBatch)
            return self._fast_gqa(q, cache, batch, scale)
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
        if self.fast:
            assert isinstance(batch, PCPForwardBatch)
            with torch.profiler.record_function("pcp.mla"):
                return self._fast_mla(q, cache, batch, kv_b_weight, dims, scale)
        h = q.shape[1]

        def attend(qs: torch.Tensor, pos: torch.Tensor, i: int, ctx: int) -> torch.Tensor:
            lat = gather_pages(cache, batch.block_tables[i], ctx)
            c_kv, k_pe = lat[:, : dims.kv_lora_rank], lat[:, dims.kv_lora_rank :]
            kv = torch.nn.functional.linear(c_kv, kv_b_weight).view(ctx, h, dims.qk_nope_head_dim + dims.v_head_dim)
            k_nope, v = kv.split([dims.qk_nope_head_dim, dims.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_pe[:, None, :].expand(ctx, h, k_pe.shape[-1])], dim=-1)
            return attention_at(qs, k, v, pos, scale)

        return self._per_seq(q, batch, attend, dims.v_head_dim)
