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
    paged_gqa_attention_triton   GQA over [num_pages, page_size, 2, Hkv, D] pages
    paged_mla_attention_triton   MLA over [num_pages, page_size, kv_lora_rank + rope] latent pages:
                                 weight-absorbed (decode / short chunks) or expanded (long prefill chunks)
Building blocks for the engine backend (metadata built once per step, reused by every layer):
    pack_block_tables, plan_gqa + attention_fwd, plan_mla + run_mla (mla_absorbed / mla_expanded)
Design notes, the prefill-vs-SDPA decision and limits: README.md next to this file.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_utils import check_device, dot_config, next_pow2

LOG2E = 1.4426950408889634


@triton.jit
def _mm(a, b, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    else:
        return tl.dot(a, b, input_precision=PREC)


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
):
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
        b_s = _mm(b_qa, tl.trans(b_ka), DOT_F32, PREC)
        if HAS_KB:
            p_kb = KB + off_kb[:, None] + i_kvh * stride_kb_h + o_db[None, :]
            b_kb = tl.load(p_kb, mask=m_n[:, None] & m_db[None, :], other=0.0)
            b_s += _mm(b_qb, tl.trans(b_kb), DOT_F32, PREC)
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
        b_acc = b_acc * b_alpha[:, None] + _mm(b_p.to(b_v.dtype), b_v, DOT_F32, PREC)
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
):
    """O[t, h] = sum_s 2^(lse_s - lse) * OP[s, t, h] with lse = log2 sum_s 2^lse_s (log2 domain)."""
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


# ----------------------------------------------------------------------------------------------------------
# Launch metadata
# ----------------------------------------------------------------------------------------------------------


@dataclass
class AttnMeta:
    """Device-side description of one launch over a subset of a batch's sequences.

    qsl [n+1]: row starts of each sequence in this launch's q / out tensors (compacted);
    ctx [n]: context length after this step; block_tables [n, P] (paged) or kv_start [n] (contiguous K/V);
    work [W, 2]: (sequence, first row) per program along grid axis 0;
    qpos0 [n] (optional): position of each sequence's first query token, the others following every
    ``pos_stride`` positions (None: the last q_len positions, stride 1).
    """

    qsl: torch.Tensor
    ctx: torch.Tensor
    block_tables: torch.Tensor | None
    kv_start: torch.Tensor | None
    work: torch.Tensor
    num_seqs: int
    num_tokens: int
    max_q_len: int
    max_ctx: int
    group: int
    block_m: int
    qpos0: torch.Tensor | None = None
    pos_stride: int = 1


def pack_block_tables(block_tables: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """N per-sequence page lists -> [N, max_pages] int32 (zero padded; padding is never read).

    One cat + one scatter on the device whatever N is (lengths are read from shapes, no sync).
    """
    n = len(block_tables)
    lens = [int(t.shape[0]) for t in block_tables]
    width = max(lens, default=0)
    out = torch.zeros(n, max(width, 1), dtype=torch.int32, device=device)
    if width == 0:
        return out
    flat = torch.cat([t.reshape(-1).to(device=device) for t in block_tables]).to(torch.int32)
    idx = torch.cat([torch.arange(length, dtype=torch.int64) + i * out.shape[1] for i, length in enumerate(lens)])
    out.view(-1)[idx.to(device)] = flat
    return out


def build_attn_meta(
    q_lens: Sequence[int],
    context_lens: Sequence[int],
    group: int,
    block_m: int,
    device: torch.device,
    block_tables: torch.Tensor | None = None,
    kv_start: Sequence[int] | None = None,
    q_pos0: Sequence[int] | None = None,
    pos_stride: int = 1,
) -> AttnMeta:
    """Metadata for ``attention_fwd``. ``q_lens`` / ``context_lens`` are per sequence (host lists);
    pass the packed ``block_tables`` [n, P] for paged K/V or ``kv_start`` for contiguous K/V.

    Query token ``j`` of sequence ``i`` is at position ``q_pos0[i] + j * pos_stride`` (strided positions, PCP:
    a rank's share of a round-robin striped chunk); the default ``q_pos0=None`` means the last ``q_len``
    positions (``context_len - q_len``, stride 1). Keys always cover the whole context."""
    n = len(context_lens)
    if len(q_lens) != n:
        raise ValueError(f"{len(q_lens)} q_lens but {n} context_lens")
    if pos_stride < 1:
        raise ValueError(f"pos_stride must be >= 1, got {pos_stride}")
    if q_pos0 is None and pos_stride != 1:
        raise ValueError(f"pos_stride {pos_stride} needs q_pos0 (the default positions are the last q_len, stride 1)")
    if q_pos0 is not None and len(q_pos0) != n:
        raise ValueError(f"{len(q_pos0)} q_pos0 but {n} context_lens")
    qsl = [0]
    work: list[tuple[int, int, int]] = []
    for i, (ql, ctx) in enumerate(zip(q_lens, context_lens, strict=True)):
        if ql < 0 or ql > ctx:
            raise ValueError(f"sequence {i}: q_len {ql} must be in [0, context_len {ctx}]")
        if q_pos0 is None:
            p0 = ctx - ql
        else:
            p0 = q_pos0[i]
            if p0 < 0:
                raise ValueError(f"sequence {i}: q_pos0 {p0} must be >= 0")
            if ql > 0 and p0 + (ql - 1) * pos_stride >= ctx:
                raise ValueError(
                    f"sequence {i}: last query position {p0} + ({ql} - 1) * {pos_stride} = "
                    f"{p0 + (ql - 1) * pos_stride} must be < context_len {ctx}"
                )
        qsl.append(qsl[-1] + ql)
        for r0 in range(0, ql * group, block_m):
            last_tok = (min(r0 + block_m, ql * group) - 1) // group
            work.append((p0 + last_tok * pos_stride + 1, i, r0))  # keys this program reads
    work.sort(key=lambda w: -w[0])  # longest first: better tail for causal prefill
    ints = qsl + list(context_lens) + [x for _, i, r0 in work for x in (i, r0)]
    if kv_start is not None:
        ints += list(kv_start)
    if q_pos0 is not None:
        ints += list(q_pos0)
    host = torch.tensor(ints, dtype=torch.int32)
    dev = host.to(device, non_blocking=True)
    o = 0
    qsl_t, o = dev[o : o + n + 1], o + n + 1
    ctx_t, o = dev[o : o + n], o + n
    work_t, o = dev[o : o + 2 * len(work)].view(-1, 2), o + 2 * len(work)
    kvs_t, o = (dev[o : o + n], o + n) if kv_start is not None else (None, o)
    qp0_t = dev[o : o + n] if q_pos0 is not None else None
    return AttnMeta(
        qsl=qsl_t,
        ctx=ctx_t,
        block_tables=block_tables,
        kv_start=kvs_t,
        work=work_t,
        num_seqs=n,
        num_tokens=qsl[-1],
        max_q_len=max(q_lens, default=0),
        max_ctx=max(context_lens, default=0),
        group=group,
        block_m=block_m,
        qpos0=qp0_t,
        pos_stride=pos_stride,
    )


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def choose_splits(meta: AttnMeta, num_kv_heads: int, block_n: int, device: torch.device) -> int:
    """Split the key axis when there are too few programs to fill the GPU (decode at small batch)."""
    programs = int(meta.work.shape[0]) * num_kv_heads
    target = 2 * _num_sms(device)
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
    big_d = da + db > 256
    block_m = meta.block_m
    block_n = block_n or (16 if big_d else 64)
    num_warps = num_warps or (8 if big_d else 4)
    if num_splits is None:
        num_splits = choose_splits(meta, hkv, block_n, q_a.device)
    split_len = -(-max(meta.max_ctx, 1) // num_splits)
    split_len = -(-split_len // block_n) * block_n
    num_splits = -(-max(meta.max_ctx, 1) // split_len)

    dot_f32, prec = dot_config(q_a.dtype)
    if out is None:
        out = q_a.new_empty(t, hq, dv)
    if num_splits > 1:
        o_part = torch.empty(num_splits, t, hq, dv, dtype=torch.float32, device=q_a.device)
        lse = torch.empty(num_splits, t, hq, dtype=torch.float32, device=q_a.device)
        o_buf, s_o = o_part, (o_part.stride(0), o_part.stride(1), o_part.stride(2))
        s_l = (lse.stride(0), lse.stride(1))
    else:
        o_part, lse = None, out
        o_buf, s_o = out, (0, out.stride(0), out.stride(1))
        s_l = (0, 0)
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
        o_buf,
        lse,
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
        *s_o,
        *s_l,
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
        num_stages=2,
    )
    if num_splits > 1:
        _merge_splits_kernel[(t, hq)](
            o_part,
            lse,
            out,
            num_splits,
            o_part.stride(0),
            o_part.stride(1),
            o_part.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            DV=dv,
            BLOCK_DV=next_pow2(dv),
            num_warps=4,
        )
    return out


def default_block_m(group: int, max_q_len: int, dv: int) -> int:
    """Rows per program: the launch's rows rounded up to a power of 2 in [16, 64] (16 is the smallest tl.dot
    tile); 16 when the value is wider than 256 (MLA's latent: a [16, 512] fp32 accumulator already fills
    the registers)."""
    cap = 16 if dv > 256 else 64
    return min(cap, max(16, next_pow2(max_q_len * group)))


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


def absorb_weights(kv_b_weight: torch.Tensor, num_heads: int, nope: int, v_dim: int):
    """kv_b [H*(nope+v), R] -> (W_UK [H, nope, R], W_UV [H, v, R]) views."""
    w = kv_b_weight.view(num_heads, nope + v_dim, kv_b_weight.shape[-1])
    return w[:, :nope], w[:, nope:]


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
) -> torch.Tensor:
    """MLA in the weight-absorbed form: attention over the latent itself (one shared "KV head").

    q_lat = q_nope . W_UK ([T, H, R]); scores = (q_lat . c_kv + q_pe . k_pe) * scale;
    o_lat = softmax . c_kv ([T, H, R]); out = o_lat . W_UV^T ([T, H, v]). ``meta.group`` must be H.
    """
    h = q.shape[1]
    w_uk, w_uv = absorb_weights(kv_b_weight, h, qk_nope_head_dim, v_head_dim)
    q_nope, q_pe = q[..., :qk_nope_head_dim], q[..., qk_nope_head_dim:]
    # [H, T, nope] @ [H, nope, R] -> [H, T, R]
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q.dtype)).transpose(0, 1).contiguous()
    q_pe = q_pe.contiguous()
    lat = latent_cache[:, :, None, :]  # [P, S, 1, R + rope]
    o_lat = attention_fwd(
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
    # [H, T, R] @ [H, R, v] -> [H, T, v]
    return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2).to(o_lat.dtype)).transpose(0, 1)


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
    h = q.shape[1]
    kv = torch.nn.functional.linear(latent[:, :kv_lora_rank], kv_b_weight.to(latent.dtype))
    kv = kv.view(latent.shape[0], h, qk_nope_head_dim + v_head_dim)
    k_pe = latent[:, None, kv_lora_rank:].expand(latent.shape[0], h, latent.shape[1] - kv_lora_rank)
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
    latent_rows: flat latent-cache rows of their contexts, sequences concatenated (expanded form only).
    """

    expanded: bool
    rows: torch.Tensor | None
    meta: AttnMeta
    latent_rows: torch.Tensor | None


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
    parts = []
    for expanded in (False, True):
        seqs = [i for i in range(n) if use_expanded[i] == expanded]
        if not seqs:
            continue
        rows = None
        if len(seqs) < n:
            rows = torch.cat([torch.arange(query_start_loc[i], query_start_loc[i + 1]) for i in seqs]).to(device)
        sub_ql = [q_lens[i] for i in seqs]
        sub_ctx = [context_lens[i] for i in seqs]
        sub_p0 = None if q_pos0 is None else [q_pos0[i] for i in seqs]
        pos = dict(q_pos0=sub_p0, pos_stride=pos_stride)
        sub_bt = block_tables if len(seqs) == n else block_tables[torch.tensor(seqs, device=block_tables.device)]
        if expanded:
            kv_start = [sum(sub_ctx[:j]) for j in range(len(seqs))]
            meta = build_attn_meta(sub_ql, sub_ctx, 1, 64, device, kv_start=kv_start, **pos)
            latent_rows = gather_latent_rows(sub_bt, sub_ctx, page_size)
        else:
            block_m = default_block_m(num_heads, max(sub_ql), kv_lora_rank)
            meta = build_attn_meta(sub_ql, sub_ctx, num_heads, block_m, device, block_tables=sub_bt, **pos)
            latent_rows = None
        parts.append(MLAPart(expanded, rows, meta, latent_rows))
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
) -> torch.Tensor:
    """Run the launches of ``plan_mla`` for one layer -> [T, H, v_head_dim] in q's dtype."""
    out = q.new_empty(q.shape[0], q.shape[1], v_head_dim)
    for part in parts:
        sub_q = q if part.rows is None else q[part.rows]
        if part.expanded:
            latent = latent_cache.view(-1, latent_cache.shape[-1])[part.latent_rows]
            o = mla_expanded(sub_q, latent, part.meta, kv_b_weight, kv_lora_rank, qk_nope_head_dim, v_head_dim, scale)
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
            )
        if part.rows is None:
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


def plan_gqa(
    query_start_loc: Sequence[int],
    context_lens: Sequence[int],
    block_tables: torch.Tensor,
    group: int,
    device: torch.device,
    head_dim: int = 128,
    q_pos0: Sequence[int] | None = None,
    pos_stride: int = 1,
) -> AttnMeta:
    """Metadata of a GQA step (``block_tables`` packed [N, P]); built once per step, reused by every layer.
    ``q_pos0`` / ``pos_stride``: strided query positions (``build_attn_meta``)."""
    q_lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(context_lens))]
    block_m = default_block_m(group, max(q_lens, default=0), head_dim)
    return build_attn_meta(
        q_lens, context_lens, group, block_m, device, block_tables=block_tables, q_pos0=q_pos0, pos_stride=pos_stride
    )


def attention_flops(q_lens: Sequence[int], context_lens: Sequence[int], heads: int, d_qk: int, d_v: int) -> float:
    """Useful causal FLOPs (2 per MAC) of a varlen batch, for benchmarks."""
    pairs = sum(ql * ctx - ql * (ql - 1) / 2 for ql, ctx in zip(q_lens, context_lens, strict=True))
    return 2.0 * pairs * heads * (d_qk + d_v)


__all__ = [
    "MLA_EXPAND_MIN_Q_LEN",
    "AttnMeta",
    "MLAPart",
    "attention_flops",
    "attention_fwd",
    "build_attn_meta",
    "default_block_m",
    "gather_latent_rows",
    "mla_absorbed",
    "mla_expanded",
    "pack_block_tables",
    "paged_gqa_attention_triton",
    "paged_mla_attention_triton",
    "plan_gqa",
    "plan_mla",
    "run_mla",
]
