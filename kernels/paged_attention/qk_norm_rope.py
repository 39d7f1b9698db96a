"""Qwen3's per-head q / k RMSNorm, RoPE and the K | V cache write in one launch. Contract: the model's ops
(``AttentionBackend.gqa_qk_norm_rope_write``: the norm backend's norms, ``RotaryEmbedding``, ``write_kv``).

Unfused, a GQA layer ran ~20 launches between its q | k | v projection and the attention: a contiguous copy and a
norm each for q and k, the rotary's elementwise ops (angles, cos, sin, casts, the rotate-half concatenations, the
products and sums) and the K | V stack and scatter; at one token each is a few microseconds of latency. Here one
program takes one head of one token: a q head is normalised, rotated and stored; a kv head's k is normalised,
rotated and stored at the token's cache slot with its v beside it (slot -1: a prefix-cached row, not written).

Numerics follow the unfused ops': the norm in fp32 stored in the activations' dtype (fla's norm), then the rotation
in that dtype with every product and sum rounded as torch's elementwise ops round them (cos / sin of the fp32 angle
rounded first). The launch turns Triton's FP fusion off: with it, LLVM reads ``(a * b).to(bf16)`` then a bf16 sum as
bf16 arithmetic and contracts the two into one ``fma.rn.bf16`` (the PTX had four), which skips the product's own
rounding; on the H200 that left only 74-81 % of bf16 values bit-equal to the contract (thirty-fourth session).
Without it the PTX has ``mul.rn.bf16`` / ``add.rn.bf16``, which round as torch's fp32 ops then a bf16 cast do (a
product of two bf16 values and a sum of two are exact in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_utils import check_device, next_pow2


@triton.jit
def _rotated(X, W, pos, INV_FREQ, eps, D, HALF: tl.constexpr, DT: tl.constexpr):
    """Both halves of one normed, rotated head: x [D] at X, norm weight W, the token's position."""
    o = tl.arange(0, HALF)
    m = o < D // 2
    x1 = tl.load(X + o, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(X + D // 2 + o, mask=m, other=0.0).to(tl.float32)
    rstd = 1 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
    w1 = tl.load(W + o, mask=m, other=0.0).to(tl.float32)
    w2 = tl.load(W + D // 2 + o, mask=m, other=0.0).to(tl.float32)
    y1 = (x1 * rstd * w1).to(DT).to(tl.float32)  # the norm's output, as it is stored
    y2 = (x2 * rstd * w2).to(DT).to(tl.float32)
    ang = pos * tl.load(INV_FREQ + o, mask=m, other=0.0)  # the fp32 angle torch forms
    # cos / sin in fp64 (accurate range reduction for angles of long contexts), rounded as torch's fp32 ones are
    c = tl.cos(ang.to(tl.float64)).to(tl.float32).to(DT).to(tl.float32)
    s = tl.sin(ang.to(tl.float64)).to(tl.float32).to(DT).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded to DT
    r1 = ((y1 * c).to(DT).to(tl.float32) + (-y2 * s).to(DT).to(tl.float32)).to(DT)
    r2 = ((y2 * c).to(DT).to(tl.float32) + (y1 * s).to(DT).to(tl.float32)).to(DT)
    return r1, r2, o, m


@triton.jit
def _qk_norm_rope_write_kernel(
    Q,  # [T, H, D] by strides (a column view of the packed projection)
    K,  # [T, KVH, D]
    V,  # [T, KVH, D]
    QW,  # [D]
    KW,  # [D]
    POS,  # [T]
    INV_FREQ,  # [D / 2] fp32
    SLOTS,  # [T] (-1: not written)
    Q_OUT,  # [T, H, D] contiguous
    CACHE,  # [rows, 2, KVH, D] (the pages, flat)
    H,
    KVH,
    D,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    eps,
    HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.load(POS + t).to(tl.float32)
    if h < H:
        r1, r2, o, m = _rotated(Q + t * stride_q_t + h * stride_q_h, QW, pos, INV_FREQ, eps, D, HALF,
                                Q_OUT.dtype.element_ty)  # fmt: skip
        out = Q_OUT + (t * H + h) * D
        tl.store(out + o, r1, mask=m)
        tl.store(out + D // 2 + o, r2, mask=m)
    else:
        kh = h - H
        slot = tl.load(SLOTS + t).to(tl.int64)
        if slot >= 0:
            r1, r2, o, m = _rotated(K + t * stride_k_t + kh * stride_k_h, KW, pos, INV_FREQ, eps, D, HALF,
                                    Q_OUT.dtype.element_ty)  # fmt: skip
            k_out = CACHE + (slot * 2 * KVH + kh) * D
            tl.store(k_out + o, r1.to(CACHE.dtype.element_ty), mask=m)
            tl.store(k_out + D // 2 + o, r2.to(CACHE.dtype.element_ty), mask=m)
            v_out = CACHE + ((slot * 2 + 1) * KVH + kh) * D
            od = tl.arange(0, 2 * HALF)
            v = tl.load(V + t * stride_v_t + kh * stride_v_h + od, mask=od < D, other=0.0)
            tl.store(v_out + od, v.to(CACHE.dtype.element_ty), mask=od < D)


def qk_norm_rope_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """q [T, H, D], k / v [T, KVH, D] (unit last stride: views of the packed projection are read in place), the
    per-head norm weights [D], positions [T], inv_freq [D / 2] (the rotary's), cache [pages, page_size, 2, KVH, D]
    contiguous, slot_mapping [T] (flat cache rows, -1 skipped) -> the normed, rotated q [T, H, D] in q's dtype; k
    (normed, rotated) and v written to the cache."""
    check_device("qk_norm_rope_write", q, k, v, q_norm_weight, k_norm_weight, positions, inv_freq, cache, slot_mapping)
    if q.ndim != 3 or k.ndim != 3 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q [T, H, D], k and v [T, KVH, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    t, h, d = q.shape
    kvh = k.shape[1]
    if d % 2 or inv_freq.shape != (d // 2,) or q_norm_weight.shape != (d,) or k_norm_weight.shape != (d,):
        raise ValueError(f"an even head dim D = {d}, inv_freq [D / 2] and norm weights [D] expected")
    if any(x.stride(2) != 1 for x in (q, k, v)):
        raise ValueError("q, k and v need a unit stride on the head dim")
    if cache.ndim != 5 or cache.shape[2:] != (2, kvh, d) or not cache.is_contiguous():
        raise ValueError(f"cache must be a contiguous [pages, page_size, 2, {kvh}, {d}], got {tuple(cache.shape)}")
    if positions.shape != (t,) or slot_mapping.shape != (t,):
        raise ValueError(f"positions and slot_mapping must be [{t}]")
    q_out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    _qk_norm_rope_write_kernel[(t, h + kvh)](
        q, k, v, q_norm_weight, k_norm_weight, positions, inv_freq.float().contiguous(), slot_mapping, q_out, cache,
        h, kvh, d, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), float(eps),
        HALF=next_pow2(d // 2), num_warps=1 if d <= 128 else 2,
        enable_fp_fusion=False,  # else LLVM folds a product's bf16 rounding and the sum into one fma.rn.bf16
    )  # fmt: skip
    return q_out


__all__ = ["qk_norm_rope_write"]
