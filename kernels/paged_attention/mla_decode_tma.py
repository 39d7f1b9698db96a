"""The all-heads MLA decode of ``mla_decode.py`` (heads-major) with the latent pages read through TMA.

Why: compiled for sm_90 the pointer kernel (32-key tiles, 4 warps) holds 255 registers a thread and spills;
Nsight Compute saw 2 programs an SM, 0.34 eligible warps per scheduler and DRAM at 36 % of its peak at 64 x 32k.
Its ``cp.async`` copies need an address per 16 bytes of every [32, 576] tile, computed by the warps that also
run the MMAs and the softmax. Here each page of the latent cache is one box of a 3-D tensor descriptor over
``[num_pages, page_size, R + P]``: the copy engine writes it to shared memory, the addresses leave the
registers, and deeper pipelines fit (a 16-key page is 18 KB).

A key tile is ``TILE_PAGES`` whole pages (1 or 2; a split starts on a tile boundary, so every box is one
page). A sequence's last, partial tile is read page by page with masked pointer loads (rows past the context
hold whatever the cache has there, stale rows, possibly NaN, and a box would bring them in), by a program of
its own: the key splits cover whole tiles only, and one more split per sequence takes the partial tile. On
the H200 (Triton 3.6) a program that ran the TMA loop and then such a tail read out of bounds (an illegal
address; the interpreter ran it exactly); each alone ran right, so no program does both.

Same contract, outputs and split merge as ``mla_decode.mla_decode_fwd``, which launches this kernel for
``latent_tma=True``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.paged_attention.mla_decode import queries_and_state
from kernels.triton_utils import mm


@triton.jit
def _page_rows(
    C_DESC, PE_DESC, LAT, stride_lat_p, stride_lat_s, page, first_key, hi,
    PAGE_SIZE: tl.constexpr, R: tl.constexpr, P: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One page's latent rows c [PAGE, R] and pe [PAGE, P]: a whole page by TMA; the split's tail page by masked
    pointer loads (rows at or past ``hi`` read as zeros, never the cache's stale rows)."""
    if MASKED:
        o_n = tl.arange(0, PAGE_SIZE)
        m_n = first_key + o_n < hi
        row = LAT + page.to(tl.int64) * stride_lat_p + o_n[:, None].to(tl.int64) * stride_lat_s
        b_c = tl.load(row + tl.arange(0, R)[None, :], mask=m_n[:, None], other=0.0)
        b_pe = tl.load(row + R + tl.arange(0, P)[None, :], mask=m_n[:, None], other=0.0)
    else:
        b_c = C_DESC.load([page, 0, 0]).reshape(PAGE_SIZE, R)
        b_pe = PE_DESC.load([page, 0, R]).reshape(PAGE_SIZE, P)
    return b_c, b_pe


@triton.jit
def _page_step(
    b_ql, b_qp, b_m, b_l, b_acc, C_DESC, PE_DESC, LAT, stride_lat_p, stride_lat_s, page, first_key, hi, qk_scale,
    PAGE_SIZE: tl.constexpr, R: tl.constexpr, P: tl.constexpr, KEYS_MAJOR: tl.constexpr, MASKED: tl.constexpr,
    DOT_F32: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Online softmax over one page. Heads-major: s = q_lat c^T + q_pe pe^T [BLOCK_H, PAGE], acc [BLOCK_H, R]
    += p c. Keys-major ("swap AB", as in ``mla_decode.py``; q given transposed): s^T = c q_lat^T + pe q_pe^T
    [PAGE, BLOCK_H] and acc^T [R, BLOCK_H] += c^T p^T, so the MMAs' M is the page's keys / the R latent dims,
    not the heads: with pages of 64 both MMAs are Hopper's wgmma, their operands straight from shared memory."""
    b_c, b_pe = _page_rows(
        C_DESC, PE_DESC, LAT, stride_lat_p, stride_lat_s, page, first_key, hi, PAGE_SIZE, R, P, MASKED
    )
    m_n = first_key + tl.arange(0, PAGE_SIZE) < hi
    if KEYS_MAJOR:
        b_s = (mm(b_c, b_ql, DOT_F32, PREC) + mm(b_pe, b_qp, DOT_F32, PREC)) * qk_scale
        if MASKED:
            b_s = tl.where(m_n[:, None], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 0))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_p = tl.exp2(b_s - b_m_safe[None, :])
        b_alpha = tl.exp2(b_m - b_m_safe)
        b_l = b_l * b_alpha + tl.sum(b_p, 0)
        b_acc = b_acc * b_alpha[None, :] + mm(tl.trans(b_c), b_p.to(b_c.dtype), DOT_F32, PREC)
    else:
        b_s = (mm(b_ql, tl.trans(b_c), DOT_F32, PREC) + mm(b_qp, tl.trans(b_pe), DOT_F32, PREC)) * qk_scale
        if MASKED:
            b_s = tl.where(m_n[None, :], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_m_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_p = tl.exp2(b_s - b_m_safe[:, None])
        b_alpha = tl.exp2(b_m - b_m_safe)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_acc = b_acc * b_alpha[:, None] + mm(b_p.to(b_c.dtype), b_c, DOT_F32, PREC)
    return b_m_new, b_l, b_acc


@triton.jit
def _page_pair_step(
    b_ql, b_qp, b_m, b_l, b_acc, C_DESC, PE_DESC, LAT, stride_lat_p, stride_lat_s, page0, page1, first_key, hi,
    qk_scale, PAGE_SIZE: tl.constexpr, R: tl.constexpr, P: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Heads-major over two whole pages with one rescale (a 2-page key tile; never a tail)."""
    b_c0, b_pe0 = _page_rows(C_DESC, PE_DESC, LAT, 0, 0, page0, first_key, hi, PAGE_SIZE, R, P, False)
    b_c1, b_pe1 = _page_rows(C_DESC, PE_DESC, LAT, 0, 0, page1, first_key, hi, PAGE_SIZE, R, P, False)
    b_s0 = (mm(b_ql, tl.trans(b_c0), DOT_F32, PREC) + mm(b_qp, tl.trans(b_pe0), DOT_F32, PREC)) * qk_scale
    b_s1 = (mm(b_ql, tl.trans(b_c1), DOT_F32, PREC) + mm(b_qp, tl.trans(b_pe1), DOT_F32, PREC)) * qk_scale
    b_m_new = tl.maximum(b_m, tl.maximum(tl.max(b_s0, 1), tl.max(b_s1, 1)))
    b_alpha = tl.exp2(b_m - b_m_new)  # finite: every key of a whole page is in the split
    b_p0 = tl.exp2(b_s0 - b_m_new[:, None])
    b_p1 = tl.exp2(b_s1 - b_m_new[:, None])
    b_l = b_l * b_alpha + tl.sum(b_p0, 1) + tl.sum(b_p1, 1)
    b_acc = b_acc * b_alpha[:, None] + mm(b_p0.to(b_c0.dtype), b_c0, DOT_F32, PREC)
    b_acc += mm(b_p1.to(b_c1.dtype), b_c1, DOT_F32, PREC)
    return b_m_new, b_l, b_acc


@triton.jit
def _mla_decode_tma_kernel(
    QL, QP, C_DESC, PE_DESC, LAT, OUT, LSE, BT, CTX, qk_scale,
    stride_ql_b, stride_ql_h, stride_qp_b, stride_qp_h, stride_lat_p, stride_lat_s,
    stride_o_x, stride_o_b, stride_o_h, stride_l_x, stride_l_b, stride_bt, split_len,
    H: tl.constexpr, PAGE_SIZE: tl.constexpr, R: tl.constexpr, P: tl.constexpr, BLOCK_H: tl.constexpr,
    TILE_PAGES: tl.constexpr, KEYS_MAJOR: tl.constexpr, DOT_F32: tl.constexpr,
    PREC: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    i_b = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    BLOCK_N: tl.constexpr = PAGE_SIZE * TILE_PAGES
    ctx = tl.load(CTX + i_b)
    ctx_whole = ctx // BLOCK_N * BLOCK_N
    is_tail = i_s == tl.num_programs(1) - 1  # the last program of a sequence takes its partial tile only
    if is_tail:
        lo = ctx_whole
        hi = ctx
    else:
        lo = i_s * split_len
        hi = tl.minimum(lo + split_len, ctx_whole)

    b_ql, b_qp, b_acc, b_m, b_l = queries_and_state(
        QL, QP, i_b, stride_ql_b, stride_ql_h, stride_qp_b, stride_qp_h, H, R, P, BLOCK_H, R, P, KEYS_MAJOR
    )
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_r = tl.arange(0, R)

    bt_row = BT + i_b * stride_bt
    if is_tail:  # masked pointer loads, page by page; no loop to pipeline
        for i in tl.static_range(TILE_PAGES):
            if lo + i * PAGE_SIZE < hi:
                b_m, b_l, b_acc = _page_step(
                    b_ql, b_qp, b_m, b_l, b_acc, C_DESC, PE_DESC, LAT, stride_lat_p, stride_lat_s,
                    tl.load(bt_row + lo // PAGE_SIZE + i), lo + i * PAGE_SIZE, hi, qk_scale, PAGE_SIZE, R, P,
                    KEYS_MAJOR, True, DOT_F32, PREC,
                )  # fmt: skip
    else:  # whole key tiles: TMA boxes, no masks
        for t in tl.range(0, tl.maximum(hi - lo, 0) // BLOCK_N, num_stages=NUM_STAGES):
            j = (lo + t * BLOCK_N) // PAGE_SIZE
            if TILE_PAGES == 2:
                b_m, b_l, b_acc = _page_pair_step(
                    b_ql, b_qp, b_m, b_l, b_acc, C_DESC, PE_DESC, LAT, stride_lat_p, stride_lat_s,
                    tl.load(bt_row + j), tl.load(bt_row + j + 1), 0, 0, qk_scale, PAGE_SIZE, R, P, DOT_F32, PREC,
                )  # fmt: skip
            else:
                b_m, b_l, b_acc = _page_step(
                    b_ql, b_qp, b_m, b_l, b_acc, C_DESC, PE_DESC, LAT, stride_lat_p, stride_lat_s,
                    tl.load(bt_row + j), 0, 0, qk_scale, PAGE_SIZE, R, P, KEYS_MAJOR, False, DOT_F32, PREC,
                )  # fmt: skip

    b_l_safe = tl.where(b_l == 0.0, 1.0, b_l)  # an empty split (or ctx 0) writes zeros and lse -inf
    if KEYS_MAJOR:
        b_o = tl.trans(b_acc / b_l_safe[None, :])  # [BLOCK_H, R]
    else:
        b_o = b_acc / b_l_safe[:, None]
    p_o = OUT + i_s * stride_o_x + i_b * stride_o_b + o_h[:, None] * stride_o_h + o_r[None, :]
    tl.store(p_o, b_o.to(OUT.dtype.element_ty), mask=m_h[:, None])
    b_lse = tl.where(b_l == 0.0, float("-inf"), b_m + tl.log2(b_l_safe))
    tl.store(LSE + i_s * stride_l_x + i_b * stride_l_b + o_h, b_lse, mask=m_h)


MEASURED_PAGE = 64  # the page size whose keys-major TMA launch beat the pointer kernel on the H200
# TANDEM_MLA_DECODE_TMA=0 keeps pages of 64 on the pointer kernel (A / B runs)
MLA_DECODE_TMA = os.environ.get("TANDEM_MLA_DECODE_TMA", "1") != "0"


def measured_launch(latent_cache: torch.Tensor, r: int, p: int) -> dict | None:
    """The launch the H200 sweep chose for this cache, or None where the pointer kernel stays
    (``python -m bench.mla_decode_sweep --tma only --page 64``, eighteenth session: 64 x 32k 1.166 ms against
    1.214 for the pointer kernel on the same pages, 64 x 4k 0.180 against 0.198; on pages of 16, where a key
    tile must be two boxes meeting ``mma.sync``, every TMA launch lost). Hopper or newer, 16-bit latents
    ``[num_pages, 64, r + p]`` the kernel can read."""
    if not (MLA_DECODE_TMA and latent_cache.is_cuda and latent_cache.dtype in (torch.bfloat16, torch.float16)):
        return None
    if latent_cache.shape[1] != MEASURED_PAGE or torch.cuda.get_device_capability(latent_cache.device) < (9, 0):
        return None
    launch = dict(latent_tma=True, keys_major=True, block_n=MEASURED_PAGE, num_warps=8, num_stages=2)
    return None if tma_refusal(latent_cache, r, p, MEASURED_PAGE, True) else launch


def tma_refusal(latent_cache: torch.Tensor, r: int, p: int, block_n: int, keys_major: bool) -> str | None:
    """Why the TMA kernel cannot read this cache with ``block_n``-key tiles, or None when it can."""
    page_size = latent_cache.shape[1]
    if not 16 <= page_size <= 256:
        return f"a page is one box and one MMA operand: 16 to 256 rows, got {page_size}"
    if block_n % page_size or block_n // page_size not in (1, 2):
        return f"a key tile must be 1 or 2 whole pages of {page_size}, got block_n={block_n}"
    if keys_major and block_n != page_size:
        return f"keys-major takes one page a key tile: block_n={page_size}, got {block_n}"
    if r & (r - 1) or p & (p - 1) or r < 16 or p < 16:
        return f"the latent widths must be powers of 2 >= 16 (a box each), got R={r}, P={p}"
    es = latent_cache.element_size()
    if latent_cache.data_ptr() % 16 or (latent_cache.stride(0) * es) % 16 or (latent_cache.stride(1) * es) % 16:
        return "TMA needs a 16-byte aligned cache with 16-byte page and row strides"
    return None


def launch(
    q_lat, q_pe, latent_cache, split, block_tables, ctx_lens, qk_scale, split_len, block_h, tile_keys, keys_major,
    dot_f32, prec, num_warps, num_stages,
) -> None:  # fmt: skip
    """One launch over (sequences, splits) into ``split`` (``triton.SplitOutputs``); arguments checked by
    ``mla_decode_fwd`` (and ``tma_refusal``)."""
    b, h, r = q_lat.shape
    p = q_pe.shape[2]
    page_size = latent_cache.shape[1]
    c_desc = TensorDescriptor.from_tensor(latent_cache, [1, page_size, r])
    pe_desc = TensorDescriptor.from_tensor(latent_cache, [1, page_size, p])
    _mla_decode_tma_kernel[(b, split.num_splits)](  # the last split: each sequence's partial tile
        q_lat, q_pe, c_desc, pe_desc, latent_cache, split.o, split.lse, block_tables, ctx_lens, qk_scale,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), latent_cache.stride(0),
        latent_cache.stride(1),
        *split.o_strides, *split.lse_strides, block_tables.stride(0), split_len,
        H=h, PAGE_SIZE=page_size, R=r, P=p, BLOCK_H=block_h, TILE_PAGES=tile_keys // page_size,
        KEYS_MAJOR=keys_major, DOT_F32=dot_f32, PREC=prec, NUM_STAGES=num_stages,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


__all__ = ["MEASURED_PAGE", "launch", "measured_launch", "tma_refusal"]
