"""KDA's low-rank up-projections (f_b and g_b) of a decode step, run by extra programs of the short conv's launch.

A KDA layer's gate and output gate are low-rank: in_proj writes f_a | g_a (2 x K = 2 x 128 columns), and f_b, g_b
[P, K] lift them to the P = H x K channels (``KimiDeltaAttention.fg_b``: both as one [2, P, K] tensor). At one row
that is one batched GEMM of 2 MB of weights: a ~3.3 us cuBLAS launch on the H100, 6 of a b1 step's ~105
(docs/PERFORMANCE.md, twenty-ninth session's kernel table), latency more than bytes. The short conv that follows
reads the same in_proj output and does not depend on the up-projections, so a few more of its programs compute
them (``short_conv_update(..., low_rank=...)``): one launch a layer fewer. Contract: ``naive_low_rank_up``
(kernels/short_conv/naive.py), the batched GEMM with fp32 sums rounded to the output dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_utils import check_device, dot_config, mm

LOW_RANK_BLOCK_CS = (16, 32, 64, 128, 256)
"""The caps ``LowRankUp.max_block_c`` may take: the channels a program, a power of two that a tl.dot tile takes."""


@dataclass(frozen=True)
class LowRankUp:
    """out [2, T, P] = a[:, j] [T, K] @ b[j] [P, K]^T for j = 0, 1. a is [T, 2, K] (a column view of in_proj's
    output: unit stride on K), b [2, P, K] with a unit stride on K, out a contiguous [2, T, P] of a's dtype.
    max_block_c caps the channels a program (a power of two, 16-256): each output's sum over K is the same at any
    cap, only its program changes; a smaller cap needs fewer registers (kernels/short_conv/in_proj_conv.py)."""

    a: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor
    max_block_c: int = 256

    def check(self, rows: int) -> None:
        a, b, out = self.a, self.b, self.out
        if a.ndim != 3 or a.shape[:2] != (rows, 2) or b.ndim != 3 or b.shape[0] != 2 or a.shape[2] != b.shape[2]:
            raise ValueError(
                f"low_rank: a must be [{rows}, 2, K] and b [2, P, K], got {tuple(a.shape)} and {tuple(b.shape)}"
            )
        if a.stride(2) != 1 or b.stride(2) != 1:
            raise ValueError("low_rank: a and b need a unit stride on K")
        if out.shape != (2, rows, b.shape[1]) or not out.is_contiguous() or not a.dtype == b.dtype == out.dtype:
            raise ValueError(f"low_rank: out must be a contiguous [2, {rows}, {b.shape[1]}] of a's dtype {a.dtype}")
        if not a.device == b.device == out.device:
            raise ValueError("low_rank: a, b and out must be on one device")
        if self.max_block_c not in LOW_RANK_BLOCK_CS:
            raise ValueError(f"low_rank: max_block_c must be a power of two in [16, 256], got {self.max_block_c}")


def low_rank_tiles(p: int, k: int, programs: int) -> tuple[int, int]:
    """(channels a program, K a step): about ``programs`` programs for the 2 x P channels, 16-256 channels each."""
    block_c = max(16, min(256, triton.next_power_of_2(triton.cdiv(2 * p, max(programs, 1)))))
    return block_c, max(16, min(64, triton.next_power_of_2(k)))


@triton.jit
def low_rank_up_block(
    A,
    B,
    OUT,
    i_blk,
    T,
    P,
    K,
    stride_a_t,
    stride_a_j,
    stride_b_j,
    stride_b_c,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    A_CACHE: tl.constexpr,
):
    """Block ``i_blk`` of the 2 x cdiv(P, BLOCK_C) output blocks: OUT[j, :, c block] for all T rows, 16 at a time
    (a tl.dot tile; decode steps have few rows). A_CACHE: A's load cache modifier (".cg" where other programs of
    the same launch wrote A: kernels/short_conv/in_proj_conv.py)."""
    n_c = tl.cdiv(P, BLOCK_C)
    j = i_blk // n_c
    o_c = (i_blk % n_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < P
    p_b = B + j * stride_b_j + o_c[None, :].to(tl.int64) * stride_b_c
    for t0 in range(0, T, 16):
        o_t = t0 + tl.arange(0, 16)
        m_t = o_t < T
        acc = tl.zeros([16, BLOCK_C], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < K
            a = tl.load(A + o_t[:, None].to(tl.int64) * stride_a_t + j * stride_a_j + o_k[None, :],
                        mask=m_t[:, None] & m_k[None, :], other=0.0, cache_modifier=A_CACHE)  # fmt: skip
            b = tl.load(p_b + o_k[:, None], mask=m_k[:, None] & m_c[None, :], other=0.0)  # [BLOCK_K, BLOCK_C]
            acc += mm(a, b, DOT_F32, PREC)
        p_out = OUT + (j * T + o_t[:, None]).to(tl.int64) * P + o_c[None, :]
        tl.store(p_out, acc.to(OUT.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])


def low_rank_args(
    low_rank: LowRankUp | None, rows: int, c_blocks: int, x: torch.Tensor
) -> tuple[tuple, dict[str, object]]:
    """The kernel's LR_* arguments (placeholders, never read, without ``low_rank``) and constexprs."""
    if low_rank is None:
        return (x, x, x, 0, 0, 0, 0, 0, 0, 0, 0), dict(LOW_RANK=False, LR_BLOCK_C=16, LR_BLOCK_K=16, DOT_F32=False,
                                                       PREC="ieee")  # fmt: skip
    low_rank.check(rows)
    check_device("short_conv_update(low_rank)", x, low_rank.a, low_rank.b, low_rank.out)
    a, b = low_rank.a, low_rank.b
    p, k = b.shape[1], b.shape[2]
    block_c, block_k = low_rank_tiles(p, k, c_blocks)
    block_c = max(16, min(block_c, low_rank.max_block_c))
    dot_f32, prec = dot_config(a.dtype)
    blocks = 2 * triton.cdiv(p, block_c)
    args = (a, b, low_rank.out, rows, p, k, blocks, a.stride(0), a.stride(1), b.stride(0), b.stride(1))
    return args, dict(LOW_RANK=True, LR_BLOCK_C=block_c, LR_BLOCK_K=block_k, DOT_F32=dot_f32, PREC=prec)


__all__ = ["LOW_RANK_BLOCK_CS", "LowRankUp", "low_rank_args", "low_rank_tiles", "low_rank_up_block"]
