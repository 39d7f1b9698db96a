"""MLA over the latent page cache with the paged-attention kernel: the weight-absorbed form (decode, spec
verify, short chunks) and the expanded form (long prefill chunks), planned per step (``plan_mla``) and run
per layer (``run_mla``). Why two forms and where they cross over: README.md next to this file."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend

from kernels.env import env_switch
from kernels.flashmla.decode import RANK, ROPE, DecodeSchedule, flashmla_decode_fwd, use_flashmla
from kernels.gemv.heads import head_gemv
from kernels.paged_attention.meta import AttnMeta, build_attn_meta, default_block_m, pack_block_tables
from kernels.paged_attention.mla_decode import mla_decode_fwd
from kernels.paged_attention.sdpa_prefill import causal_self_attention, cudnn_self_attention_usable, mla_keys_values
from kernels.paged_attention.triton import _check_varlen, attention_fwd
from kernels.triton_utils import check_device
from kernels.upload import upload


def absorb_weights(kv_b_weight: torch.Tensor, num_heads: int, nope: int, v_dim: int):
    """kv_b [H*(nope+v), R] -> (W_UK [H, nope, R], W_UV [H, v, R]) views."""
    w = kv_b_weight.view(num_heads, nope + v_dim, kv_b_weight.shape[-1])
    return w[:, :nope], w[:, nope:]


# Decode launches (one query per sequence) take the all-heads kernel (kernels/paged_attention/mla_decode.py): the
# latent is read once for all 32 heads instead of once per 16 (H200: 1.25-1.6x faster at batch 16-64).
# TANDEM_MLA_ALL_HEADS=0 keeps them on the general kernel, for A/B runs.
MLA_ALL_HEADS = env_switch("TANDEM_MLA_ALL_HEADS", True)

# One query (a batch-1 decode step): q_nope through W_UK and the latent output through W_UV^T by the per-head GEMV
# (kernels/gemv/heads.py) instead of cuBLAS's batched GEMMs of one row, FlashMLA's rope columns copied by the same
# launch. TANDEM_MLA_HEAD_GEMV=0 keeps the batched GEMMs, for A/B runs.
MLA_HEAD_GEMV = env_switch("TANDEM_MLA_HEAD_GEMV", True)


def _one_query_gemv(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x [1, H, K] goes through ``head_gemv`` with the per-head weight w [H, K, N]."""
    return MLA_HEAD_GEMV and x.shape[0] == 1 and x.dtype == w.dtype and x.stride(-1) == 1


def _all_heads_decode(meta: AttnMeta) -> bool:
    one_query_each = meta.max_q_len == 1 and meta.num_tokens == meta.num_seqs
    return MLA_ALL_HEADS and one_query_each and meta.qpos0 is None and meta.block_tables is not None


def mla_absorbed(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    meta: AttnMeta,
    kv_b_weight: torch.Tensor,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    schedules: dict | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLA in the weight-absorbed form: attention over the latent itself (one shared "KV head").

    q_lat = q_nope . W_UK ([T, H, R]); scores = (q_lat . c_kv + q_pe . k_pe) * scale;
    o_lat = softmax . c_kv ([T, H, R]); out = o_lat . W_UV^T ([T, H, v]). ``meta.group`` must be H.
    schedules: a dict that lives for one step (the backend's ``PerStep``), where FlashMLA decode launches
    keep the split plan the step's MLA layers share (``DecodeSchedule``); None: each launch plans its own.
    out: a [T, H, v] buffer in q's dtype for the result (``run_mla``'s), else one is allocated.
    """
    h = q.shape[1]
    w_uk, w_uv = absorb_weights(kv_b_weight, h, qk_nope_head_dim, v_head_dim)
    q_nope, q_pe = q[..., :qk_nope_head_dim], q[..., qk_nope_head_dim:]
    decode = _all_heads_decode(meta) and num_splits is None and block_n is None
    if decode and use_flashmla(latent_cache, h):
        o_lat = _flashmla_absorbed(q_nope, q_pe, w_uk, latent_cache, meta, scale, schedules)
    else:
        tuning = (decode, num_splits, block_n)
        o_lat = _triton_absorbed(q_nope, q_pe, w_uk, latent_cache, meta, kv_lora_rank, scale, *tuning)
    # [H, T, R] @ [H, R, v] -> [H, T, v], written as [T, H, v] (straight into ``out`` when its dtype is o_lat's)
    direct = out is not None and out.dtype == o_lat.dtype
    o = out if direct else o_lat.new_empty(o_lat.shape[0], h, v_head_dim)
    if _one_query_gemv(o_lat, w_uv):
        head_gemv(o_lat[0], w_uv.transpose(1, 2), out=o[0])
    else:
        torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2).to(o_lat.dtype), out=o.transpose(0, 1))
    if out is not None and not direct:
        return out.copy_(o)
    return o


def _triton_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    w_uk: torch.Tensor,
    latent_cache: torch.Tensor,
    meta: AttnMeta,
    kv_lora_rank: int,
    scale: float,
    decode: bool,
    num_splits: int | None,
    block_n: int | None,
) -> torch.Tensor:
    """o_lat [T, H, R] through the Triton kernels: the all-heads decode kernel or the general paged one."""
    if _one_query_gemv(q_nope, w_uk):
        q_lat = head_gemv(q_nope[0], w_uk)[None]
    else:  # [H, T, nope] @ [H, nope, R] -> [H, T, R]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1).contiguous()
    q_pe = q_pe.contiguous()
    if decode:
        return mla_decode_fwd(q_lat, q_pe, latent_cache, meta.block_tables, meta.ctx, meta.max_ctx, scale)
    lat = latent_cache[:, :, None, :]  # [P, S, 1, R + rope]
    return attention_fwd(
        q_lat,
        lat[..., :kv_lora_rank],
        None,
        meta,
        scale,
        q_b=q_pe,
        k_b=lat[..., kv_lora_rank:],
        num_splits=num_splits,
        block_n=block_n,
    )


def _flashmla_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    w_uk: torch.Tensor,
    latent_cache: torch.Tensor,
    meta: AttnMeta,
    scale: float,
    schedules: dict | None,
) -> torch.Tensor:
    """The decode launch through FlashMLA: q_lat is written by its GEMM straight into FlashMLA's [T, H, 576]
    query (cuBLAS takes the slice's row stride) and the rope part copied beside it, instead of a transpose
    copy, a contiguous copy and a concatenation; the split plan comes from the step's shared schedule."""
    t, h = q_nope.shape[0], q_nope.shape[1]
    if (w_uk.shape[-1], q_pe.shape[-1]) != (RANK, ROPE):  # the rest is checked by flashmla_decode_fwd
        raise ValueError(f"flashmla_decode_fwd: latent {w_uk.shape[-1]} + rope {q_pe.shape[-1]}, not {RANK} + {ROPE}")
    q = q_nope.new_empty(t, h, RANK + ROPE)
    q_lat, q_rope = q[..., :RANK], q[..., RANK:]
    if _one_query_gemv(q_nope, w_uk) and q_pe.stride(-1) == 1:  # the rope columns copied by the same launch
        head_gemv(q_nope[0], w_uk, out=q_lat[0], tail=q_pe[0])
    else:
        torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype), out=q_lat.transpose(0, 1))
        q_rope.copy_(q_pe)
    key = ("flashmla", h, meta.ctx.data_ptr(), t)
    schedule = None if schedules is None else schedules.setdefault(key, DecodeSchedule())
    return flashmla_decode_fwd(q_lat, q_rope, latent_cache, meta.block_tables, meta.ctx, scale, schedule=schedule, q=q)


def _expand_latent(
    latent: torch.Tensor, kv_b_weight: torch.Tensor, num_heads: int, kv_lora_rank: int, nope_plus_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent rows [R, rank + rope] -> (k_nope | v [R, H, nope + v], k_pe [R, H, rope] with head stride 0)."""
    kv = torch.nn.functional.linear(latent[:, :kv_lora_rank], kv_b_weight.to(latent.dtype))
    kv = kv.view(latent.shape[0], num_heads, nope_plus_v)
    k_pe = latent[:, None, kv_lora_rank:].expand(latent.shape[0], num_heads, latent.shape[1] - kv_lora_rank)
    return kv, k_pe


def mla_expanded(
    q: torch.Tensor,
    latent: torch.Tensor,
    meta: AttnMeta,
    kv_b_weight: torch.Tensor,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:
    """MLA in the expanded form over a *contiguous* latent [R_total, R + rope] (``meta.kv_start`` per sequence).

    k_nope | v = c_kv . kv_b^T ([R_total, H, nope + v]); k_pe is read from the latent with head stride 0.
    Cheaper than the absorbed form for long query chunks (see README.md).
    """
    kv, k_pe = _expand_latent(latent, kv_b_weight, q.shape[1], kv_lora_rank, qk_nope_head_dim + v_head_dim)
    return attention_fwd(
        q[..., :qk_nope_head_dim],
        kv[..., :qk_nope_head_dim],
        kv[..., qk_nope_head_dim:],
        meta,
        scale,
        q_b=q[..., qk_nope_head_dim:],
        k_b=k_pe,
    )


def gather_latent_rows(block_tables: torch.Tensor, context_lens: Sequence[int], page_size: int) -> torch.Tensor:
    """Flat cache rows (page * page_size + offset) of every context token, sequences concatenated."""
    device = block_tables.device
    rows = []
    for i, ctx in enumerate(context_lens):
        n_pages = -(-ctx // page_size)
        r = block_tables[i, :n_pages].to(torch.int64)[:, None] * page_size + torch.arange(page_size, device=device)
        rows.append(r.reshape(-1)[:ctx])
    return torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64, device=device)


# A query chunk this long or longer uses the expanded form: the absorbed form does ~(R+rope+R)/(nope+rope+v)
# = 3.4x the attention FLOPs, the expanded form pays R*H*(nope+v) per context token once (see README.md).
MLA_EXPAND_MIN_Q_LEN = 192


@dataclass
class MLAPart:
    """One launch of an MLA step: a subset of sequences in one form.

    rows: their query rows in the batch (None: all rows, in order); meta: kernel metadata;
    latent_rows: flat latent-cache rows of their contexts, sequences concatenated (expanded form only);
    self_lens: set when every sequence of an expanded part has no prefix (its keys are its own query rows,
    at consecutive positions): their lengths, for the SDPA path (``sdpa_prefill.py``).
    """

    expanded: bool
    rows: torch.Tensor | None
    meta: AttnMeta
    latent_rows: torch.Tensor | None
    self_lens: tuple[int, ...] | None = None


def mla_self_attention_sdpa(
    q: torch.Tensor,
    latent: torch.Tensor,
    seq_lens: Sequence[int],
    kv_b_weight: torch.Tensor,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    scale: float,
    backend: SDPBackend = SDPBackend.CUDNN_ATTENTION,
) -> torch.Tensor:
    """The expanded form for sequences with no prefix (``latent`` holds exactly their rows, in query order),
    through torch SDPA: keys ``k_nope | k_pe`` whole per head ([T, H, nope + rope]) straight out of one GEMM
    (``sdpa_prefill.mla_keys_values``)."""
    k, v = mla_keys_values(latent, kv_b_weight, q.shape[1], kv_lora_rank, qk_nope_head_dim, v_head_dim)
    return causal_self_attention(q, k, v, seq_lens, scale, backend)


def plan_mla(
    query_start_loc: Sequence[int],
    context_lens: Sequence[int],
    block_tables: torch.Tensor,
    num_heads: int,
    page_size: int,
    kv_lora_rank: int,
    device: torch.device,
    expand_min_q_len: int | None = MLA_EXPAND_MIN_Q_LEN,
    q_pos0: Sequence[int] | None = None,
    pos_stride: int = 1,
) -> list[MLAPart]:
    """Split a batch's sequences into an absorbed and an expanded launch (empty ones dropped).

    ``block_tables`` is the packed [N, P] table (``pack_block_tables``). Built once per step and reused by
    every MLA layer (``run_mla``). ``q_pos0`` / ``pos_stride``: strided query positions (``build_attn_meta``).
    """
    n = len(context_lens)
    q_lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(n)]
    use_expanded = [expand_min_q_len is not None and ql >= expand_min_q_len for ql in q_lens]
    # expanded sequences with no prefix (keys = their own rows, consecutive positions) get a launch of their
    # own, which the SDPA path may take (run_mla); "absorbed" / "expanded" / "self"
    form = [
        ("self" if q_pos0 is None and q_lens[i] == context_lens[i] else "expanded") if use_expanded[i] else "absorbed"
        for i in range(n)
    ]
    parts = []
    for kind in ("absorbed", "expanded", "self"):
        seqs = [i for i in range(n) if form[i] == kind]
        if not seqs:
            continue
        expanded = kind != "absorbed"
        rows = None
        if len(seqs) < n:
            rows = upload(torch.cat([torch.arange(query_start_loc[i], query_start_loc[i + 1]) for i in seqs]), device)
        sub_ql = [q_lens[i] for i in seqs]
        sub_ctx = [context_lens[i] for i in seqs]
        sub_p0 = None if q_pos0 is None else [q_pos0[i] for i in seqs]
        pos = dict(q_pos0=sub_p0, pos_stride=pos_stride)
        sub_bt = block_tables if len(seqs) == n else block_tables[torch.tensor(seqs, device=block_tables.device)]
        self_lens = None
        if expanded:
            kv_start = [sum(sub_ctx[:j]) for j in range(len(seqs))]
            meta = build_attn_meta(sub_ql, sub_ctx, 1, 64, device, kv_start=kv_start, **pos)
            latent_rows = gather_latent_rows(sub_bt, sub_ctx, page_size)
            if kind == "self":
                self_lens = tuple(sub_ql)
        else:
            block_m = default_block_m(num_heads, max(sub_ql), kv_lora_rank)
            meta = build_attn_meta(sub_ql, sub_ctx, num_heads, block_m, device, block_tables=sub_bt, **pos)
            latent_rows = None
        parts.append(MLAPart(expanded, rows, meta, latent_rows, self_lens))
    return parts


def run_mla(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    parts: Sequence[MLAPart],
    kv_b_weight: torch.Tensor,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    schedules: dict | None = None,
) -> torch.Tensor:
    """Run the launches of ``plan_mla`` for one layer -> [T, H, v_head_dim] in q's dtype. schedules: the
    step's dict of shared decode plans (``mla_absorbed``)."""
    out = q.new_empty(q.shape[0], q.shape[1], v_head_dim)
    for part in parts:
        sub_q = q if part.rows is None else q[part.rows]
        if part.expanded:
            sub_q = sub_q.contiguous()  # the absorbed form reads a strided q in place, the expanded kernels not
            latent = latent_cache.view(-1, latent_cache.shape[-1])[part.latent_rows]
            dims = (kv_lora_rank, qk_nope_head_dim, v_head_dim)
            if part.self_lens is not None and cudnn_self_attention_usable(q.dtype, q.device, q.shape[-1], v_head_dim):
                o = mla_self_attention_sdpa(sub_q, latent, part.self_lens, kv_b_weight, *dims, scale)
            else:
                o = mla_expanded(sub_q, latent, part.meta, kv_b_weight, *dims, scale)
        else:
            o = mla_absorbed(
                sub_q,
                latent_cache,
                part.meta,
                kv_b_weight,
                kv_lora_rank,
                qk_nope_head_dim,
                v_head_dim,
                scale,
                num_splits=num_splits,
                block_n=block_n,
                schedules=schedules,
                out=out if part.rows is None else None,  # the whole batch: written in place
            )
        if part.rows is None:
            if o is not out:
                out.copy_(o)
        else:
            out[part.rows] = o.to(out.dtype)
    return out


def paged_mla_attention_triton(
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
    expand_min_q_len: int | None = MLA_EXPAND_MIN_Q_LEN,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """MLA over a latent page cache; drop-in for ``naive.paged_mla_attention``.

    Args:
        q: [T, H, nope + rope] (rope part unrotated: Kimi-Linear is NoPE).
        latent_cache: [num_pages, page_size, kv_lora_rank + rope] (normed c_kv | k_pe).
        query_start_loc / context_lens / block_tables: as ``paged_gqa_attention_triton``.
        kv_b_weight: [H * (nope + v), kv_lora_rank].
        scale: (nope + rope)^-1/2 for Kimi-Linear (the unrotated rope dims count).
        expand_min_q_len: sequences with at least this many query rows use the expanded form, the others
            the absorbed form (None: always absorbed; 0: always expanded).
        num_splits / block_n: tuning of the absorbed form (see ``paged_gqa_attention_triton``).
    Returns: [T, H, v_head_dim] in q's dtype.
    """
    check_device("paged_mla_attention_triton", q, latent_cache, kv_b_weight)
    h, rope = q.shape[1], latent_cache.shape[-1] - kv_lora_rank
    if latent_cache.ndim != 3 or q.ndim != 3 or q.shape[-1] != qk_nope_head_dim + rope:
        raise ValueError(f"q {tuple(q.shape)} / latent_cache {tuple(latent_cache.shape)} do not fit the MLA dims")
    if kv_b_weight.shape != (h * (qk_nope_head_dim + v_head_dim), kv_lora_rank):
        raise ValueError(f"kv_b_weight must be [{h * (qk_nope_head_dim + v_head_dim)}, {kv_lora_rank}]")
    _check_varlen(q, query_start_loc, context_lens, block_tables)
    bt = pack_block_tables(block_tables, q.device)
    parts = plan_mla(
        query_start_loc, context_lens, bt, h, latent_cache.shape[1], kv_lora_rank, q.device, expand_min_q_len
    )
    return run_mla(
        q, latent_cache, parts, kv_b_weight, kv_lora_rank, qk_nope_head_dim, v_head_dim, scale, num_splits, block_n
    )


__all__ = [
    "MLA_EXPAND_MIN_Q_LEN",
    "MLAPart",
    "absorb_weights",
    "gather_latent_rows",
    "mla_absorbed",
    "mla_expanded",
    "paged_mla_attention_triton",
    "plan_mla",
    "run_mla",
]
