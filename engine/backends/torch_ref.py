"""Reference backends: the plain PyTorch ops from kernels/*/naive.py, on any device."""

from __future__ import annotations

import torch

from engine.backends.base import AttentionBackend, KDABackend, MLADims, MoEBackend
from engine.forward_batch import ForwardBatch
from kernels.kda.naive import naive_chunk_kda, naive_recurrent_kda
from kernels.moe.naive import naive_moe, sigmoid_topk_route
from kernels.paged_attention.naive import paged_gqa_attention, paged_mla_attention, scatter_pages
from kernels.short_conv.naive import naive_short_conv


class TorchAttentionBackend(AttentionBackend):
    def write_kv(self, cache: torch.Tensor, batch: ForwardBatch, entries: torch.Tensor) -> None:
        scatter_pages(cache, batch.slot_mapping, entries)

    def gqa(self, q: torch.Tensor, cache: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
        return paged_gqa_attention(q, cache, batch.query_start_loc, batch.context_lens, batch.block_tables, scale)

    def mla(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        batch: ForwardBatch,
        kv_b_weight: torch.Tensor,
        dims: MLADims,
        scale: float,
    ) -> torch.Tensor:
        return paged_mla_attention(
            q,
            cache,
            batch.query_start_loc,
            batch.context_lens,
            batch.block_tables,
            kv_b_weight,
            dims.kv_lora_rank,
            dims.qk_nope_head_dim,
            dims.v_head_dim,
            scale,
        )


class TorchKDABackend(KDABackend):
    def short_conv(
        self, x: torch.Tensor, conv_cache: torch.Tensor, weight: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        out = torch.empty_like(x)
        w = weight.shape[1]
        for i, slot in enumerate(batch.state_slots):
            s, e = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            window = conv_cache[slot] if batch.has_initial_state[i] else None
            start = batch.context_lens[i] - (e - s)
            if batch.checkpoints and batch.checkpoints[i]:
                # the window after k tokens of this chunk is columns k .. k+W-2 of [window | x^T]
                prev = window if window is not None else x.new_zeros(x.shape[1], w - 1)
                xs = torch.cat([prev.to(x.dtype), x[s:e].t()], dim=-1)
                for pos, dst in batch.checkpoints[i]:
                    conv_cache[dst] = xs[:, pos - start : pos - start + w - 1]
            out[s:e], conv_cache[slot] = naive_short_conv(x[s:e], weight, window)
        return out

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
        if batch.is_decode_only and all(batch.has_initial_state):
            # one token per sequence: a single batched step over all slots
            slots = torch.tensor(batch.state_slots, device=q.device)
            o, state = naive_recurrent_kda(
                q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], state_cache[slots]
            )
            state_cache[slots] = state
            for i, cks in enumerate(batch.checkpoints):
                for _, dst in cks:  # a one-token chunk's rung is its end
                    state_cache[dst] = state[i]
            return o[:, 0]
        out = torch.empty(*v.shape, dtype=torch.float32, device=v.device)
        for i, slot in enumerate(batch.state_slots):
            s, e = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            start = batch.context_lens[i] - (e - s)
            state = state_cache[slot : slot + 1] if batch.has_initial_state[i] else None
            # split the chunk at its rungs, so the state at each rung can be filed
            cks = batch.checkpoints[i] if batch.checkpoints else ()
            bounds = [s + pos - start for pos, _ in cks]
            seg_start = s
            for seg_end in [*bounds, e]:
                if seg_end > seg_start:
                    fn = naive_recurrent_kda if seg_end - seg_start == 1 else naive_chunk_kda
                    sl = slice(seg_start, seg_end)
                    o, state = fn(q[None, sl], k[None, sl], v[None, sl], g[None, sl], beta[None, sl], state)
                    out[sl] = o[0]
                seg_start = seg_end
                for pos, dst in cks:
                    if s + pos - start == seg_end:
                        state_cache[dst] = state[0]
            state_cache[slot] = state[0]
        return out


class TorchMoEBackend(MoEBackend):
    def route(
        self,
        router_logits: torch.Tensor,
        correction_bias: torch.Tensor | None,
        top_k: int,
        renormalize: bool,
        scaling_factor: float,
        extra_expert: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = sigmoid_topk_route(router_logits, correction_bias, top_k, renormalize, scaling_factor)
        if extra_expert is None:
            return weights, ids
        return torch.cat([weights, weights.new_ones(weights.shape[0], 1)], 1), torch.cat(
            [ids, ids.new_full((ids.shape[0], 1), extra_expert)], 1
        )

    def experts(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        w1: torch.Tensor,
        w3: torch.Tensor,
        w2: torch.Tensor,
        w13: torch.Tensor | None = None,
        add: torch.Tensor | None = None,
    ) -> torch.Tensor:
        y = naive_moe(x, weights, ids, w1, w3, w2)
        return y if add is None else y + add
