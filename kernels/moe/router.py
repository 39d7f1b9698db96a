"""The MoE router's GEMV for decode-sized steps as split-K partial sums. Contract: ``naive_router_partials``.

At decode the router is x [T <= 16, 2304] @ W [256, 2304]^T, 1.2 MB of weights; cuBLAS runs it on a handful of
tiles (5.7 us a layer on the H200 at batch 1 and 16, for ~0.3 us of bytes: 40 us of a batch-1 step over 7 MoE
layers). Here a grid of (expert blocks x K splits) programs each multiplies one [T, BLOCK_E] x [BLOCK_E, SPLIT]
block (bf16 products are exact in fp32, fp32 accumulation) and writes its fp32 partial sums [S, T, E]; the route
kernel (kernels/moe/triton.py) adds the S partials in split order when it loads the logits, so no launch sums
them and the result is deterministic. Not on by default until the H200 says it is faster
(``TANDEM_MOE_ROUTER_GEMV``, engine/backends/gpu_moe.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_kwargs
from kernels.triton_utils import check_device, dot_config, mm, next_pow2

SPLIT_K = 256
"""Columns of H a program covers: H = 2304 gives 9 splits, x 16 expert blocks = 144 programs (132 SMs)."""
BLOCK_E = 16


@triton.jit
def router_block(
    X,
    W,
    P,
    i_e,
    i_s,
    T,
    E,
    H,
    stride_x,
    stride_w,
    SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
):
    """Expert block ``i_e``'s partial logits over column split ``i_s``: P[i_s, :T, block] (fp32)."""
    o_t = tl.arange(0, BLOCK_T)
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    m_t, m_e = o_t < T, o_e < E
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k0 in tl.static_range(0, SPLIT, BLOCK_K):
        o_k = i_s * SPLIT + k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < H
        x = tl.load(X + o_t[:, None] * stride_x + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        w = tl.load(W + o_e[:, None] * stride_w + o_k[None, :], mask=m_e[:, None] & m_k[None, :], other=0.0)
        acc += mm(x, tl.trans(w), DOT_F32, PREC)
    p = P + i_s * T * E + o_t[:, None] * E + o_e[None, :]
    tl.store(p, acc, mask=m_t[:, None] & m_e[None, :])


@triton.jit
def _router_partials_kernel(
    X,  # [T, H]
    W,  # [E, H]
    P,  # [S, T, E] fp32 out
    T,
    E,
    H,
    stride_x,
    stride_w,
    SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    router_block(
        X, W, P, tl.program_id(0), tl.program_id(1), T, E, H, stride_x, stride_w,
        SPLIT, BLOCK_T, BLOCK_E, BLOCK_K, DOT_F32, PREC,
    )  # fmt: skip


def check_router_args(name: str, x: torch.Tensor, weight: torch.Tensor, split: int) -> None:
    """x [T <= 64, H] and weight [E, H] of one dtype with a unit stride on H; split a power of two >= 16."""
    check_device(name, x, weight)
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [T, H] and weight [E, H] must share H, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a unit stride on H")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    if split < 16 or split != next_pow2(split):
        raise ValueError(f"split must be a power of two >= 16, got {split}")
    if x.shape[0] > 64:
        raise ValueError(f"{name} is for decode-sized steps (at most 64 rows), got {x.shape[0]}")


def router_tiles(t: int, split: int, dtype: torch.dtype) -> dict[str, Any]:
    """The constexprs of ``router_block`` for T rows: one choice for every launch that computes the partials, so
    the fused route (kernels/moe/route_fused.py) adds exactly the sums ``router_partials`` gives."""
    dot_f32, prec = dot_config(dtype)
    return {
        "SPLIT": split,
        "BLOCK_T": max(16, next_pow2(t)),
        "BLOCK_E": BLOCK_E,
        "BLOCK_K": min(split, 128),
        "DOT_F32": dot_f32,
        "PREC": prec,
    }


def router_partials(x: torch.Tensor, weight: torch.Tensor, split: int = SPLIT_K) -> torch.Tensor:
    """x [T, H] @ weight [E, H]^T as [ceil(H / split), T, E] fp32 partial sums over consecutive column ranges of
    ``split`` (a power of two, >= 16); their sum in split order is the logits. T <= 64 (one row block)."""
    check_router_args("router_partials", x, weight, split)
    t, h = x.shape
    e = weight.shape[0]
    n_split = triton.cdiv(h, split)
    out = torch.empty(n_split, t, e, dtype=torch.float32, device=x.device)
    if t == 0:
        return out
    _router_partials_kernel[(triton.cdiv(e, BLOCK_E), n_split)](
        x,
        weight,
        out,
        t,
        e,
        h,
        x.stride(0),
        weight.stride(0),
        **router_tiles(t, split, x.dtype),
        num_warps=4,
        **pdl_kwargs(x, "moe.router_partials"),
    )
    return out


def route_split_from_env() -> int:
    """``TANDEM_MOE_ROUTE_SPLIT``: the router columns each router program of the one-token route + gate-up launch
    sums (kernels/moe/route_gate_up.py; a power of two >= 16, default ``SPLIT_K``). Fewer, longer router programs
    leave more of the first wave to gate-up programs and give the last one fewer partials to add, but each takes
    longer: an A / B knob for the b1 step. The logits' adds follow the split, so a launch is exact against
    ``route_then_gate_up`` at its own split, not at another."""
    raw = os.environ.get("TANDEM_MOE_ROUTE_SPLIT", "").strip()
    if not raw:
        return SPLIT_K
    split = int(raw) if raw.isascii() and raw.isdecimal() else 0
    if not 16 <= split <= 4096 or split & (split - 1):  # past 4096: one range already at Kimi's H, long unrolls
        raise ValueError(f"TANDEM_MOE_ROUTE_SPLIT must be a power of two from 16 to 4096, got {raw!r}")
    return split


__all__ = [
    "BLOCK_E",
    "SPLIT_K",
    "check_router_args",
    "route_split_from_env",
    "router_block",
    "router_partials",
    "router_tiles",
]
