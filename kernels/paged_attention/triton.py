"""Paged attention in Triton: one kernel for decode, spec-verify, chunked prefill and full prefill.

Contract: kernels/paged_attention/naive.py. Sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]``; they are its last ``q_len`` positions
``context_lens[i] - q_len .. context_lens[i] - 1`` and attend causally to every cached token at or before
their position. Token ``t`` of a sequence lives at page ``block_table[t // page_size]``, row ``t % page_size``.
Strided query positions (prefill context parallelism, PCP): with ``q_pos0`` / ``pos_stride`` (``build_attn_meta``,
``plan_gqa``, ``plan_mla``) query token ``j`` of sequence ``i`` is at ``q_pos0[i] + j * pos_stride`` instead, while
the keys still cover the whole context ``0 .. context_lens[i] - 1`` (a rank holding every ``pos_stride``-th token).

The kernel works on "rows" = (query token, query head of one KV-head group) pairs, so a GQA group (or the
32 heads of MLA's single latent "KV head") shares every K/V tile it loads:

    row r of sequence i, KV head h:  token = r // GROUP, query head = h * GROUP + r % GROUP

Keys come in up to three parts that share one page table: ``KA`` (first part of K), optional ``KB``
(second part of K, e.g. MLA's rope dims, possibly shared by all heads with head stride 0) and ``V``
(or ``V = KA`` for MLA's latent form, loaded once). Long contexts with few rows are split over the key
axis (flash-decoding); partial results are merged by ``_merge_splits_kernel``.

Public entry points (same arguments as the naive references):
    paged_gqa_attention_triton   GQA over [num_pages, page_size, 2, Hkv, D] pages (here)
    paged_mla_attention_triton   MLA over [num_pages, page_size, kv_lora_rank + rope] latent pages (mla.py):
                                 weight-absorbed (decode / short chunks) or expanded (long prefill chunks)
Building blocks for the engine backend (metadata built once per step, reused by every layer):
    meta.py: pack_block_tables, build_attn_meta, plan_gqa (+ attention_fwd here); mla.py: plan_mla + run_mla
Design notes, the prefill-vs-SDPA decision and limits: README.md next to this file.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.paged_attention.meta import (
    AttnMeta,
    attention_flops,
    build_attn_meta,
    default_block_m,
    pack_block_tables,
    plan_gqa,
)
from kernels.pdl import pdl_enter, pdl_kwargs
from kernels.triton_utils import check_device, dot_config, mm, next_pow2

LOG2E = 1.4426950408889634


@triton.jit
def _paged_attn_fwd_kernel(
    QA,
    QB,
    KA,
    KB,
    V,
    OUT,
    LSE,
    BT,
    QSL,
    CTX,
    KVS,
    QP0,
    WORK,
    qk_scale,  # softmax scale * log2(e)
    stride_qa_t,
    stride_qa_h,
    stride_qb_t,
    stride_qb_h,
    stride_ka_p,
    stride_ka_s,
    stride_ka_h,
    stride_kb_p,
    stride_kb_s,
    stride_kb_h,
    stride_v_p,
    stride_v_s,
    stride_v_h,
    stride_o_x,
    stride_o_t,
    stride_o_h,
    stride_l_x,
    stride_l_t,
    stride_bt,
    split_len,
    pos_stride,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DA: tl.constexpr,
    DB: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DA: tl.constexpr,
    BLOCK_DB: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_KB: tl.constexpr,
    V_IS_KA: tl.constexpr,
    CONTIG_KV: tl.constexpr,
    HAS_QPOS: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    i_w = tl.program_id(0)
    i_kvh = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2)
    i_n = tl.load(WORK + i_w * 2)
    row0 = tl.load(WORK + i_w * 2 + 1)
    bos = tl.load(QSL + i_n)
    q_len = tl.load(QSL + i_n + 1) - bos
    ctx = tl.load(CTX + i_n)
    n_rows = q_len * GROUP

    o_m = row0 + tl.arange(0, BLOCK_M)
    m_m = o_m < n_rows
    o_tok = o_m // GROUP
    o_hq = i_kvh * GROUP + (o_m % GROUP)
    last_tok = (tl.minimum(row0 + BLOCK_M, n_rows) - 1) // GROUP  # last valid row's token in this block
    if HAS_QPOS:  # strided positions (PCP): token j at qpos0 + j * pos_stride
        qpos0 = tl.load(QP0 + i_n)
        b_pos = qpos0 + o_tok * pos_stride  # [BLOCK_M] position of each row's query token
        kv_end = qpos0 + last_tok * pos_stride + 1
    else:  # the last q_len positions
        b_pos = ctx - q_len + o_tok  # [BLOCK_M] position of each row's query token
        kv_end = ctx - q_len + last_tok + 1
    lo = i_s * split_len
    hi = tl.minimum(lo + split_len, kv_end)

    o_t64 = (bos + o_tok).to(tl.int64)
    o_da = tl.arange(0, BLOCK_DA)
    m_da = o_da < DA
    p_qa = QA + o_t64[:, None] * stride_qa_t + o_hq[:, None] * stride_qa_h + o_da[None, :]
    b_qa = tl.load(p_qa, mask=m_m[:, None] & m_da[None, :], other=0.0)  # [BLOCK_M, BLOCK_DA]
    if HAS_KB:
        o_db = tl.arange(0, BLOCK_DB)
        m_db = o_db < DB
        p_qb = QB + o_t64[:, None] * stride_qb_t + o_hq[:, None] * stride_qb_h + o_db[None, :]
        b_qb = tl.load(p_qb, mask=m_m[:, None] & m_db[None, :], other=0.0)  # [BLOCK_M, BLOCK_DB]
    o_dv = tl.arange(0, BLOCK_DV)
    m_dv = o_dv < DV

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if CONTIG_KV:
        kv0 = tl.load(KVS + i_n).to(tl.int64)

    for start in range(lo, hi, BLOCK_N):
        o_n = start + tl.arange(0, BLOCK_N)
        m_n = o_n < hi
        if CONTIG_KV:
            o_row = kv0 + o_n
            off_ka = o_row * stride_ka_s
            off_kb = o_row * stride_kb_s
            off_v = o_row * stride_v_s
        else:
            page = tl.load(BT + i_n * stride_bt + o_n // PAGE_SIZE, mask=m_n, other=0).to(tl.int64)
            o_slot = (o_n % PAGE_SIZE).to(tl.int64)
            off_ka = page * stride_ka_p + o_slot * stride_ka_s
            off_kb = page * stride_kb_p + o_slot * stride_kb_s
            off_v = page * stride_v_p + o_slot * stride_v_s
        p_ka = KA + off_ka[:, None] + i_kvh * stride_ka_h + o_da[None, :]
        b_ka = tl.load(p_ka, mask=m_n[:, None] & m_da[None, :], other=0.0)  # [BLOCK_N, BLOCK_DA]
        # [BLOCK_M, BLOCK_DA] @ [BLOCK_DA, BLOCK_N] -> [BLOCK_M, BLOCK_N]
        b_s = mm(b_qa, tl.trans(b_ka), DOT_F32, PREC)
        if HAS_KB:
            p_kb = KB + off_kb[:, None] + i_kvh * stride_kb_h + o_db[None, :]
            b_kb = tl.load(p_kb, mask=m_n[:, None] & m_db[None, :], other=0.0)
            b_s += mm(b_qb, tl.trans(b_kb), DOT_F32, PREC)
        b_s = b_s * qk_scale
        m_causal = (o_n[None, :] <= b_pos[:, None]) & m_n[None, :]
        b_s = tl.where(m_causal, b_s, float("-inf"))

        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # rows with no key yet
        b_p = tl.exp2(b_s - b_m_safe[:, None])
        b_alpha = tl.exp2(b_m - b_m_safe)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        if V_IS_KA:
            b_v = b_ka
        else:
            p_v = V + off_v[:, None] + i_kvh * stride_v_h + o_dv[None, :]
            b_v = tl.load(p_v, mask=m_n[:, None] & m_dv[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
        # [BLOCK_M, BLOCK_N] @ [BLOCK_N, BLOCK_DV] -> [BLOCK_M, BLOCK_DV]
        b_acc = b_acc * b_alpha[:, None] + mm(b_p.to(b_v.dtype), b_v, DOT_F32, PREC)
        b_m = b_m_new

    b_o = b_acc / tl.where(b_l == 0.0, 1.0, b_l)[:, None]
    p_o = OUT + i_s * stride_o_x + o_t64[:, None] * stride_o_t + o_hq[:, None] * stride_o_h + o_dv[None, :]
    tl.store(p_o, b_o.to(OUT.dtype.element_ty), mask=m_m[:, None] & m_dv[None, :])
    if SPLIT:
        b_lse = tl.where(b_l == 0.0, float("-inf"), b_m + tl.log2(tl.where(b_l == 0.0, 1.0, b_l)))
        p_l = LSE + i_s * stride_l_x + o_t64 * stride_l_t + o_hq
        tl.store(p_l, b_lse, mask=m_m)


@triton.jit
def _merge_splits_kernel(
    OP,
    LSE,
    OUT,
    num_splits,
    stride_op_x,
    stride_op_t,
    stride_op_h,
    stride_l_x,
    stride_l_t,
    stride_o_t,
    stride_o_h,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """O[t, h] = sum_s 2^(lse_s - lse) * OP[s, t, h] with lse = log2 sum_s 2^lse_s (log2 domain)."""
    pdl_enter(USE_PDL)
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    o_dv = tl.arange(0, BLOCK_DV)
    m_dv = o_dv < DV
    b_m = tl.full([1], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([1], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for i_s in range(0, num_splits):
        b_lse = tl.load(LSE + i_s * stride_l_x + i_t * stride_l_t + i_h + tl.zeros([1], dtype=tl.int32))
        b_m_new = tl.maximum(b_m, b_lse)
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp2(b_m - b_m_safe)
        b_w = tl.exp2(b_lse - b_m_safe)
        p_op = OP + i_s * stride_op_x + i_t * stride_op_t + i_h * stride_op_h + o_dv
        b_op = tl.load(p_op, mask=m_dv, other=0.0).to(tl.float32)
        b_acc = b_acc * b_alpha + b_w * b_op
        b_l = b_l * b_alpha + b_w
        b_m = b_m_new
    b_o = b_acc / tl.where(b_l == 0.0, 1.0, b_l)
    tl.store(OUT + i_t * stride_o_t + i_h * stride_o_h + o_dv, b_o.to(OUT.dtype.element_ty), mask=m_dv)


@dataclass(frozen=True)
class SplitOutputs:
    """Where a launch over ``num_splits`` key splits writes: fp32 partial outputs [splits, T, H, DV] and their
    log2-domain log-sum-exp [splits, T, H], merged into ``out`` by ``_merge_splits_kernel``; with one split the
    kernel writes ``out`` itself (strides of split 0 only, no lse)."""

    o: torch.Tensor
    lse: torch.Tensor
    o_strides: tuple[int, int, int]
    lse_strides: tuple[int, int]
    num_splits: int

    @classmethod
    def of(cls, out: torch.Tensor, num_splits: int) -> SplitOutputs:
        t, h, dv = out.shape
        if num_splits == 1:
            return cls(out, out, (0, out.stride(0), out.stride(1)), (0, 0), 1)
        o = torch.empty(num_splits, t, h, dv, dtype=torch.float32, device=out.device)
        lse = torch.empty(num_splits, t, h, dtype=torch.float32, device=out.device)
        return cls(o, lse, (o.stride(0), o.stride(1), o.stride(2)), (lse.stride(0), lse.stride(1)), num_splits)

    def merge(self, out: torch.Tensor) -> None:
        """The splits' partial results into ``out`` (nothing to do for one split)."""
        if self.num_splits == 1:
            return
        t, h, dv = out.shape
        _merge_splits_kernel[(t, h)](
            self.o,
            self.lse,
            out,
            self.num_splits,
            *self.o_strides,
            *self.lse_strides,
            out.stride(0),
            out.stride(1),
            DV=dv,
            BLOCK_DV=next_pow2(dv),
            num_warps=4,
            **pdl_kwargs(out, "attention.merge_splits"),
        )


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def choose_splits(meta: AttnMeta, num_kv_heads: int, block_n: int, device: torch.device, waves: int = 2) -> int:
    """Split the key axis when there are too few programs to fill the GPU (decode at small batch): about
    `waves` programs per SM, each split at least 256 keys long."""
    programs = int(meta.work.shape[0]) * num_kv_heads
    target = waves * _num_sms(device)
    min_split = 256
    if programs >= target or meta.max_ctx < 2 * min_split:
        return 1
    return max(1, min(-(-target // max(programs, 1)), meta.max_ctx // min_split))


# ----------------------------------------------------------------------------------------------------------
# Generic launcher
# ----------------------------------------------------------------------------------------------------------


def _strides_phd(x: torch.Tensor) -> tuple[int, int, int]:
    """(page, slot, head) strides of a [P, S, H, D] (paged) or [R, H, D] (contiguous) key/value view."""
    if x.ndim == 4:
        if x.stride(3) != 1:
            raise ValueError("key/value views must have a unit stride on the last (dim) axis")
        return x.stride(0), x.stride(1), x.stride(2)
    if x.ndim == 3:
        if x.stride(2) != 1:
            raise ValueError("key/value views must have a unit stride on the last (dim) axis")
        return 0, x.stride(0), x.stride(1)
    raise ValueError(f"key/value views must be [P, S, H, D] or [R, H, D], got {tuple(x.shape)}")


def attention_fwd(
    q_a: torch.Tensor,
    k_a: torch.Tensor,
    v: torch.Tensor | None,
    meta: AttnMeta,
    scale: float,
    q_b: torch.Tensor | None = None,
    k_b: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    out: torch.Tensor | None = None,
    num_stages: int = 2,
) -> torch.Tensor:
    """Causal attention of this launch's rows over paged (or contiguous) keys.

    q_a [T, Hq, DA] and optional q_b [T, Hq, DB]: the two parts of each query (unit stride on the last axis).
    k_a [P, S, Hkv, DA] / k_b [P, S, Hkv|1, DB] / v [P, S, Hkv, DV] paged views sharing ``meta.block_tables``
    (or [R, Hkv, D] contiguous views with ``meta.kv_start``); a head stride of 0 broadcasts k_b.
    ``v=None`` means V is k_a itself (MLA latent form, DV = DA). Returns [T, Hq, DV] in q_a's dtype.
    """
    t, hq, da = q_a.shape
    if t != meta.num_tokens:
        raise ValueError(f"q has {t} rows but the metadata describes {meta.num_tokens}")
    contig = meta.kv_start is not None
    if not contig and meta.block_tables is None:
        raise ValueError("metadata needs block_tables (paged) or kv_start (contiguous)")
    hkv = k_a.shape[-2]
    if hq != hkv * meta.group:
        raise ValueError(f"{hq} query heads != {hkv} kv heads x group {meta.group}")
    if q_a.stride(-1) != 1 or (q_b is not None and q_b.stride(-1) != 1):
        raise ValueError("queries must have a unit stride on the last axis")
    has_kb = k_b is not None
    if has_kb != (q_b is not None):
        raise ValueError("q_b and k_b go together")
    db = q_b.shape[-1] if has_kb else 0
    v_is_ka = v is None
    dv = da if v_is_ka else v.shape[-1]
    page_size = 1 if contig else k_a.shape[1]
    # MLA's latent form (576-wide keys, 512-wide values): 32-key tiles, 4 warps, twice the programs per SM
    # (bench/mla_decode_sweep.py on the H200: 2.7x faster than 16-key tiles with 8 warps at 64 x 4k)
    big_d = da + db > 256
    block_m = meta.block_m
    block_n = block_n or (32 if big_d else 64)
    num_warps = num_warps or 4
    if num_splits is None:
        num_splits = choose_splits(meta, hkv, block_n, q_a.device, waves=4 if big_d else 2)
    split_len = -(-max(meta.max_ctx, 1) // num_splits)
    split_len = -(-split_len // block_n) * block_n
    num_splits = -(-max(meta.max_ctx, 1) // split_len)

    dot_f32, prec = dot_config(q_a.dtype)
    if out is None:
        out = q_a.new_empty(t, hq, dv)
    split = SplitOutputs.of(out, num_splits)
    ska = _strides_phd(k_a)
    skb = _strides_phd(k_b) if has_kb else (0, 0, 0)
    sv = _strides_phd(v) if not v_is_ka else (0, 0, 0)
    bt = meta.block_tables if not contig else meta.qsl
    kvs = meta.kv_start if contig else meta.qsl
    has_qpos = meta.qpos0 is not None
    qp0 = meta.qpos0 if has_qpos else meta.qsl
    grid = (int(meta.work.shape[0]), hkv, num_splits)
    if grid[0] == 0:
        return out
    _paged_attn_fwd_kernel[grid](
        q_a,
        q_b if has_kb else q_a,
        k_a,
        k_b if has_kb else k_a,
        k_a if v_is_ka else v,
        split.o,
        split.lse,
        bt,
        meta.qsl,
        meta.ctx,
        kvs,
        qp0,
        meta.work,
        scale * LOG2E,
        q_a.stride(0),
        q_a.stride(1),
        q_b.stride(0) if has_kb else 0,
        q_b.stride(1) if has_kb else 0,
        *ska,
        *skb,
        *sv,
        *split.o_strides,
        *split.lse_strides,
        bt.stride(0) if not contig else 0,
        split_len,
        meta.pos_stride if has_qpos else 1,
        GROUP=meta.group,
        PAGE_SIZE=page_size,
        DA=da,
        DB=max(db, 1),
        DV=dv,
        BLOCK_DA=max(16, next_pow2(da)),
        BLOCK_DB=max(16, next_pow2(db)),
        BLOCK_DV=max(16, next_pow2(dv)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_KB=has_kb,
        V_IS_KA=v_is_ka,
        CONTIG_KV=contig,
        HAS_QPOS=has_qpos,
        SPLIT=num_splits > 1,
        DOT_F32=dot_f32,
        PREC=prec,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_kwargs(q_a, "attention.paged_attn"),
    )
    split.merge(out)
    return out


# ----------------------------------------------------------------------------------------------------------
# Public wrappers (naive-compatible signatures)
# ----------------------------------------------------------------------------------------------------------


def _check_varlen(q: torch.Tensor, query_start_loc: Sequence[int], context_lens: Sequence[int], tables) -> None:
    n = len(context_lens)
    if len(query_start_loc) != n + 1 or len(tables) != n:
        raise ValueError(
            f"query_start_loc needs N+1 entries and block_tables N, got {len(query_start_loc)}, {len(tables)} for N={n}"
        )
    if query_start_loc[0] != 0 or query_start_loc[-1] != q.shape[0]:
        raise ValueError(f"query_start_loc must run from 0 to T={q.shape[0]}, got {list(query_start_loc)}")


def paged_gqa_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[torch.Tensor],
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """GQA over a K|V page cache; drop-in for ``naive.paged_gqa_attention``.

    Args:
        q: [T, Hq, D] queries of all sequences, concatenated.
        kv_cache: [num_pages, page_size, 2, Hkv, D] (K at index 0, V at 1); Hq % Hkv == 0.
        query_start_loc: N+1 row offsets (host ints). context_lens: N lengths after this step (host ints).
        block_tables: N page-id tensors (int, any device).
        num_splits: split the key axis in about this many parts (None: automatic); block_n: key tile size.
    Returns: [T, Hq, D] in q's dtype.

    Example::

        out = paged_gqa_attention_triton(q, kv, [0, 1, 5], [37, 20], [bt0, bt1], 128**-0.5)
    """
    check_device("paged_gqa_attention_triton", q, kv_cache)
    if kv_cache.ndim != 5 or kv_cache.shape[2] != 2:
        raise ValueError(f"kv_cache must be [P, S, 2, Hkv, D], got {tuple(kv_cache.shape)}")
    if q.ndim != 3 or q.shape[-1] != kv_cache.shape[-1] or q.shape[1] % kv_cache.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv_cache {tuple(kv_cache.shape)}")
    _check_varlen(q, query_start_loc, context_lens, block_tables)
    group = q.shape[1] // kv_cache.shape[3]
    meta = plan_gqa(
        query_start_loc, context_lens, pack_block_tables(block_tables, q.device), group, q.device, q.shape[-1]
    )
    q = q.contiguous()
    return attention_fwd(q, kv_cache[:, :, 0], kv_cache[:, :, 1], meta, scale, num_splits=num_splits, block_n=block_n)


__all__ = [  # the metadata helpers are re-exported: the launcher and its planners are used together
    "AttnMeta",
    "attention_flops",
    "attention_fwd",
    "build_attn_meta",
    "choose_splits",
    "default_block_m",
    "pack_block_tables",
    "paged_gqa_attention_triton",
    "plan_gqa",
]
