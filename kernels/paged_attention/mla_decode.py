"""MLA decode in the weight-absorbed ("latent") form with ONE program per (sequence, key split) for ALL heads.

Why: in the absorbed form every query head attends over the same latent rows (key = ``c_kv | k_pe``,
value = ``c_kv``), so decode is bound by reading the latent cache. The general kernel
(``triton.py::_paged_attn_fwd_kernel``) takes ``BLOCK_M`` = 16 rows per program, so Kimi-Linear's 32 heads
read every latent tile twice. Here a program holds all ``H`` heads' queries (``BLOCK_H = next_pow2(H)``)
and loads each tile of ``BLOCK_N`` latent rows (``c`` [BLOCK_N, R] and ``pe`` [BLOCK_N, P]) once.

Two formulations of the same math (constexpr ``KEYS_MAJOR``), both exact against the reference:

- heads-major: ``s = q_lat @ c^T + q_pe @ pe^T`` [BLOCK_H, BLOCK_N]; ``acc`` [BLOCK_H, R] ``+= p @ c``.
- keys-major ("swap AB"): ``s^T = c @ q_lat^T + pe @ q_pe^T`` [BLOCK_N, BLOCK_H] and
  ``acc^T`` [R, BLOCK_H] ``+= c^T @ p^T``, so the MMA's M dimension is the key tile / the 512 latent dims
  rather than the 32 heads (Hopper's wgmma wants M >= 64). Statistics live along axis 0.

Decode only: each sequence has one query at position ``ctx - 1`` that sees keys ``0 .. ctx - 1``. Long
contexts are split over the key axis (flash-decoding): each split writes fp32 partial outputs and a log2-domain
log-sum-exp, merged by ``triton.py::SplitOutputs``. The launch depends on host ints only
(shapes, ``max_ctx``, ``num_splits``): no host sync, CUDA-graph capturable.

Defaults from ``bench/mla_decode_sweep.py`` on the H200 (docs/PERFORMANCE.md, 72 configurations per workload):
heads-major, 32-key tiles, 4 warps, 2 stages; 64 x 4k 0.199 ms, 64 x 32k 1.25 ms, 16 x 32k 0.323 ms against
0.249 / 1.81 / 0.509 ms for the general kernel's launch (keys-major was never the fastest at batch >= 16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.paged_attention.triton import LOG2E, SplitOutputs, _num_sms
from kernels.pdl import pdl_enter, pdl_kwargs
from kernels.triton_utils import check_device, dot_config, mm, next_pow2

MIN_SPLIT = 128  # keys per split at least (automatic splits)
KEYS_PER_SPLIT = 1024  # automatic splits: at least one per this many keys


@triton.jit
def _mla_decode_kernel(
    QL,
    QP,
    LAT,
    OUT,
    LSE,
    BT,
    CTX,
    qk_scale,  # softmax scale * log2(e)
    stride_ql_b,
    stride_ql_h,
    stride_qp_b,
    stride_qp_h,
    stride_lat_p,
    stride_lat_s,
    stride_o_x,
    stride_o_b,
    stride_o_h,
    stride_l_x,
    stride_l_b,
    stride_bt,
    split_len,
    H: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    R: tl.constexpr,
    P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KEYS_MAJOR: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    i_b = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    ctx = tl.load(CTX + i_b)
    lo = i_s * split_len
    hi = tl.minimum(lo + split_len, ctx)

    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_r = tl.arange(0, BLOCK_R)
    m_r = o_r < R
    o_p = tl.arange(0, BLOCK_P)
    m_p = o_p < P
    p_ql = QL + i_b * stride_ql_b + o_h[:, None] * stride_ql_h + o_r[None, :]
    b_ql = tl.load(p_ql, mask=m_h[:, None] & m_r[None, :], other=0.0)  # [BLOCK_H, BLOCK_R]
    p_qp = QP + i_b * stride_qp_b + o_h[:, None] * stride_qp_h + o_p[None, :]
    b_qp = tl.load(p_qp, mask=m_h[:, None] & m_p[None, :], other=0.0)  # [BLOCK_H, BLOCK_P]
    if KEYS_MAJOR:
        b_qlt = tl.trans(b_ql)  # [BLOCK_R, BLOCK_H]
        b_qpt = tl.trans(b_qp)  # [BLOCK_P, BLOCK_H]
        b_acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    else:
        b_acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)

    for start in range(lo, hi, BLOCK_N):
        o_n = start + tl.arange(0, BLOCK_N)
        m_n = o_n < hi
        page = tl.load(BT + i_b * stride_bt + o_n // PAGE_SIZE, mask=m_n, other=0).to(tl.int64)
        off = page * stride_lat_p + (o_n % PAGE_SIZE).to(tl.int64) * stride_lat_s
        b_c = tl.load(LAT + off[:, None] + o_r[None, :], mask=m_n[:, None] & m_r[None, :], other=0.0)
        b_pe = tl.load(LAT + off[:, None] + R + o_p[None, :], mask=m_n[:, None] & m_p[None, :], other=0.0)
        if KEYS_MAJOR:
            # [BLOCK_N, R] @ [R, BLOCK_H] + [BLOCK_N, P] @ [P, BLOCK_H] -> s^T [BLOCK_N, BLOCK_H]
            b_s = mm(b_c, b_qlt, DOT_F32, PREC) + mm(b_pe, b_qpt, DOT_F32, PREC)
            b_s = tl.where(m_n[:, None], b_s * qk_scale, float("-inf"))
            b_m_new = tl.maximum(b_m, tl.max(b_s, 0))
            b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
            b_p = tl.exp2(b_s - b_m_safe[None, :])
            b_alpha = tl.exp2(b_m - b_m_safe)
            b_l = b_l * b_alpha + tl.sum(b_p, 0)
            # [BLOCK_R, BLOCK_N] @ [BLOCK_N, BLOCK_H] -> acc^T [BLOCK_R, BLOCK_H]
            b_acc = b_acc * b_alpha[None, :] + mm(tl.trans(b_c), b_p.to(b_c.dtype), DOT_F32, PREC)
        else:
            # [BLOCK_H, R] @ [R, BLOCK_N] + [BLOCK_H, P] @ [P, BLOCK_N] -> s [BLOCK_H, BLOCK_N]
            b_s = mm(b_ql, tl.trans(b_c), DOT_F32, PREC) + mm(b_qp, tl.trans(b_pe), DOT_F32, PREC)
            b_s = tl.where(m_n[None, :], b_s * qk_scale, float("-inf"))
            b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
            b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
            b_p = tl.exp2(b_s - b_m_safe[:, None])
            b_alpha = tl.exp2(b_m - b_m_safe)
            b_l = b_l * b_alpha + tl.sum(b_p, 1)
            # [BLOCK_H, BLOCK_N] @ [BLOCK_N, R] -> acc [BLOCK_H, BLOCK_R]
            b_acc = b_acc * b_alpha[:, None] + mm(b_p.to(b_c.dtype), b_c, DOT_F32, PREC)
        b_m = b_m_new

    b_l_safe = tl.where(b_l == 0.0, 1.0, b_l)  # an empty split (or ctx 0) writes zeros and lse -inf
    if KEYS_MAJOR:
        b_o = tl.trans(b_acc / b_l_safe[None, :])  # [BLOCK_H, BLOCK_R]
    else:
        b_o = b_acc / b_l_safe[:, None]
    p_o = OUT + i_s * stride_o_x + i_b * stride_o_b + o_h[:, None] * stride_o_h + o_r[None, :]
    tl.store(p_o, b_o.to(OUT.dtype.element_ty), mask=m_h[:, None] & m_r[None, :])
    if SPLIT:
        b_lse = tl.where(b_l == 0.0, float("-inf"), b_m + tl.log2(b_l_safe))
        tl.store(LSE + i_s * stride_l_x + i_b * stride_l_b + o_h, b_lse, mask=m_h)


def mla_decode_splits(batch: int, max_ctx: int, device: torch.device, waves: int = 4) -> int:
    """Key splits: about ``waves`` programs per SM, and at least one split per ``KEYS_PER_SPLIT`` keys (long
    contexts at large batch: 64 x 32k ran 1.53 / 1.31 / 1.25 ms with 9 / 18 / 36 splits on the H200), each split
    at least ``MIN_SPLIT`` keys. Host ints only."""
    by_sms = -(-waves * _num_sms(device) // max(batch, 1))
    return max(1, min(max(by_sms, max_ctx // KEYS_PER_SPLIT), max_ctx // MIN_SPLIT))


def mla_decode_fwd(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    max_ctx: int,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    keys_major: bool | None = None,
    out: torch.Tensor | None = None,
    block_h: int | None = None,
) -> torch.Tensor:
    """Absorbed-MLA decode, all heads of a sequence per program: ``softmax((q_lat c^T + q_pe pe^T) scale) c``.

    q_lat [B, H, R], q_pe [B, H, P] (unit stride on the last axis); latent_cache [num_pages, page_size, R + P]
    (``c_kv | k_pe``, unit stride on the last axis); block_tables [B, max_pages] int32 (``pack_block_tables``);
    ctx_lens [B] int32 on the device (sequence ``i`` has one query, at ``ctx_lens[i] - 1``). ``max_ctx`` is a
    host int >= every ``ctx_lens[i]`` (keys past it are never read; it only sets the split length, so a
    CUDA graph can pass a fixed upper bound). Returns o_lat [B, H, R] in q_lat's dtype (or fills ``out``).

    Tuning (None = the H200 sweep's choice): ``num_splits`` (automatic: ``mla_decode_splits``), ``block_n`` 32
    keys per tile, ``num_warps`` 4, ``num_stages`` 2, ``keys_major`` False (heads-major), ``block_h`` the heads
    rounded up to a power of 2 (>= 16); a larger ``block_h`` pads the heads tile with rows that read no query
    (64 rows: the MMA shape Hopper's wgmma takes; on the H200 it lost to 32 rows, 1.40 vs 1.22 ms at 64 x 32k).
    """
    check_device("mla_decode_fwd", q_lat, q_pe, latent_cache, block_tables, ctx_lens)
    if q_lat.ndim != 3 or q_pe.ndim != 3 or q_pe.shape[:2] != q_lat.shape[:2]:
        raise ValueError(
            f"q_lat [B, H, R] and q_pe [B, H, P] must agree, got {tuple(q_lat.shape)}, {tuple(q_pe.shape)}"
        )
    b, h, r = q_lat.shape
    p = q_pe.shape[2]
    if latent_cache.ndim != 3 or latent_cache.shape[2] != r + p:
        raise ValueError(f"latent_cache must be [num_pages, page_size, {r} + {p}], got {tuple(latent_cache.shape)}")
    if q_lat.stride(2) != 1 or q_pe.stride(2) != 1 or latent_cache.stride(2) != 1:
        raise ValueError("q_lat, q_pe and latent_cache must have a unit stride on the last axis")
    if not (q_lat.dtype == q_pe.dtype == latent_cache.dtype):
        raise ValueError(f"dtypes differ: q_lat {q_lat.dtype}, q_pe {q_pe.dtype}, latent_cache {latent_cache.dtype}")
    if block_tables.ndim != 2 or block_tables.shape[0] != b or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be int32 [{b}, max_pages], got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if ctx_lens.shape != (b,) or ctx_lens.dtype != torch.int32:
        raise ValueError(f"ctx_lens must be int32 [{b}], got {ctx_lens.dtype} {tuple(ctx_lens.shape)}")
    page_size = latent_cache.shape[1]
    if not 0 <= max_ctx <= block_tables.shape[1] * page_size:
        raise ValueError(f"max_ctx {max_ctx} must be in [0, {block_tables.shape[1]} pages x {page_size}]")
    if out is None:
        out = q_lat.new_empty(b, h, r)
    elif out.shape != (b, h, r) or out.stride(2) != 1 or out.device != q_lat.device:
        raise ValueError(f"out must be [{b}, {h}, {r}] with a unit last stride on q's device, got {tuple(out.shape)}")
    block_n = block_n or 32
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of 2 >= 16, got {block_n}")
    block_h = block_h or max(16, next_pow2(h))
    if block_h < h or block_h & (block_h - 1):
        raise ValueError(f"block_h must be a power of 2 >= the {h} heads, got {block_h}")
    keys_major = False if keys_major is None else keys_major
    num_warps = num_warps or 4
    num_stages = num_stages or 2
    if keys_major and num_stages < 2 and q_lat.is_cuda:
        # Triton 3.6 on the H200 returned wrong outputs (max |err| up to 13) for keys-major 64-key tiles, 8 warps,
        # 1 stage, in every sweep since the form was added (bench/mla_decode_sweep.py); the interpreter and
        # 2 or 3 stages agree with the reference, so the single-stage compile is refused rather than trusted
        raise ValueError("mla_decode_fwd: keys_major needs num_stages >= 2 on CUDA (1 stage miscompiled)")
    if num_splits is None:
        num_splits = mla_decode_splits(b, max_ctx, q_lat.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if b == 0 or h == 0:
        return out
    split_len = -(-max(max_ctx, 1) // num_splits)
    split_len = -(-split_len // block_n) * block_n
    num_splits = -(-max(max_ctx, 1) // split_len)

    dot_f32, prec = dot_config(q_lat.dtype)
    split = SplitOutputs.of(out, num_splits)
    _mla_decode_kernel[(b, num_splits)](
        q_lat,
        q_pe,
        latent_cache,
        split.o,
        split.lse,
        block_tables,
        ctx_lens,
        scale * LOG2E,
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        latent_cache.stride(0),
        latent_cache.stride(1),
        *split.o_strides,
        *split.lse_strides,
        block_tables.stride(0),
        split_len,
        H=h,
        PAGE_SIZE=page_size,
        R=r,
        P=p,
        BLOCK_H=block_h,
        BLOCK_R=max(16, next_pow2(r)),
        BLOCK_P=max(16, next_pow2(p)),
        BLOCK_N=block_n,
        KEYS_MAJOR=keys_major,
        SPLIT=num_splits > 1,
        DOT_F32=dot_f32,
        PREC=prec,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_kwargs(q_lat, "attention.mla_decode"),
    )
    split.merge(out)
    return out


__all__ = ["mla_decode_fwd", "mla_decode_splits"]
