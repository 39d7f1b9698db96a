"""Reference paged attention over a KV cache of fixed-size pages.

A cache is ``[num_pages, page_size, *entry]``; token ``i`` of a sequence lives at page
``block_table[i // page_size]``, row ``i % page_size``. A sequence's queries are its last
``q_len`` tokens, each attending causally to every cached token at or before its position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def scatter_pages(cache: torch.Tensor, slot_mapping: torch.Tensor, entries: torch.Tensor) -> None:
    """Write entries [T, *entry] at flat rows slot_mapping [T] (page * page_size + offset);
    rows with slot -1 are not written (their KV is already cached)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, entries = slot_mapping[keep], entries[keep]
    cache.view(-1, *cache.shape[2:])[slot_mapping] = entries.to(cache.dtype)


def write_mla_latent(
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_a: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    kv_lora_rank: int,
) -> None:
    """MLA's cache entry from kv_a_proj's output [T, kv_lora_rank + rope]: ``RMSNorm(c_kv) | k_pe``, written at
    flat rows slot_mapping [T] (-1: not written). The norm as the GPU norm kernels take it (fla's): normalise
    in fp32, scale by the weight in fp32, round once."""
    c_kv, k_pe = kv_a.split([kv_lora_rank, kv_a.shape[-1] - kv_lora_rank], dim=-1)
    xf = c_kv.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    scatter_pages(cache, slot_mapping, torch.cat([normed.to(cache.dtype), k_pe.to(cache.dtype)], dim=-1))


def qk_norm_rope_write(
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
) -> torch.Tensor:
    """Qwen3's attention input as the GPU backend's ops make it (kernels/paged_attention/qk_norm_rope.py): q [T, H,
    D] and k [T, KVH, D] each normed per head as fla's norm does (fp32, rounded once to the activations' dtype), then
    rotated as ``RotaryEmbedding`` does (cos / sin of the fp32 angles rounded to that dtype, ``x * cos +
    rotate_half(x) * sin`` in it); k | v written at flat rows slot_mapping [T] (-1: not written). Returns q."""

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        freqs = positions[:, None].float() * inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    q, k = rotate(norm(q, q_norm_weight)), rotate(norm(k, k_norm_weight))
    scatter_pages(cache, slot_mapping, torch.stack([k, v], dim=1))
    return q


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Return the first num_tokens entries of a sequence, in token order: [num_tokens, *entry]."""
    page_size = cache.shape[1]
    n_pages = -(-num_tokens // page_size)
    return cache[block_table[:n_pages]].flatten(0, 1)[:num_tokens]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Tq, H, D], k [Tk, H, D], v [Tk, H, Dv]; queries are positions Tk-Tq .. Tk-1. fp32 softmax."""
    tq, tk = q.shape[0], k.shape[0]
    return attention_at_positions(q, k, v, torch.arange(tk - tq, tk, device=q.device), scale)


def attention_at_positions(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Like ``causal_attention`` with explicit query positions q_pos [Tq] (e.g. a PCP rank's strided share
    of a chunk): query t sees keys 0 .. q_pos[t] of the whole context k / v. fp32 softmax."""
    tk = k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.arange(tk, device=q.device)[None, :] > q_pos.to(q.device)[:, None]
    scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_gqa_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D]; kv_cache [P, S, 2, Hkv, D]. Returns [T, Hq, D]."""
    out = torch.empty_like(q)
    n_rep = q.shape[1] // kv_cache.shape[3]
    for i, ctx in enumerate(context_lens):
        s, e = query_start_loc[i], query_start_loc[i + 1]
        kv = gather_pages(kv_cache, block_tables[i], ctx)
        k = kv[:, 0].repeat_interleave(n_rep, dim=1)
        v = kv[:, 1].repeat_interleave(n_rep, dim=1)
        out[s:e] = causal_attention(q[s:e], k, v, scale)
    return out


def paged_mla_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    query_start_loc: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[torch.Tensor],
    kv_b_weight: torch.Tensor,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:
    """MLA over a latent cache, expanded form (the reference; the GPU path absorbs kv_b instead).

    q [T, H, nope+rope]; latent_cache [P, S, kv_lora_rank + rope] holding the normed latent c_kv
    and the shared (unrotated, NoPE) k_pe; kv_b_weight [H*(nope+v), kv_lora_rank]. Returns [T, H, v].
    """
    h = q.shape[1]
    out = q.new_empty(q.shape[0], h, v_head_dim)
    for i, ctx in enumerate(context_lens):
        s, e = query_start_loc[i], query_start_loc[i + 1]
        lat = gather_pages(latent_cache, block_tables[i], ctx)
        c_kv, k_pe = lat[:, :kv_lora_rank], lat[:, kv_lora_rank:]
        kv = torch.nn.functional.linear(c_kv, kv_b_weight).view(ctx, h, qk_nope_head_dim + v_head_dim)
        k_nope, v = kv.split([qk_nope_head_dim, v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(ctx, h, k_pe.shape[-1])], dim=-1)
        out[s:e] = causal_attention(q[s:e], k, v, scale)
    return out
