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
        for i, slot in enumerate(batch.state_slots):
            s, e = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            window = conv_cache[slot] if batch.has_initial_state[i] else None
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
            return o[:, 0]
        out = torch.empty(*v.shape, dtype=torch.float32, device=v.device)
        for i, slot in enumerate(batch.state_slots):
            s, e = batch.query_start_loc[i], batch.query_start_loc[i + 1]
            init = state_cache[slot : slot + 1] if batch.has_initial_state[i] else None
            fn = naive_recurrent_kda if e - s == 1 else naive_chunk_kda
            o, state = fn(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e], init)
            out[s:e] = o[0]
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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return sigmoid_topk_route(router_logits, correction_bias, top_k, renormalize, scaling_factor)

    def experts(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        w1: torch.Tensor,
        w3: torch.Tensor,
        w2: torch.Tensor,
    ) -> torch.Tensor:
        return naive_moe(x, weights, ids, w1, w3, w2)
