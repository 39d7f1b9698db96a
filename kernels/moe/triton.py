"""Sigmoid top-k routing (Kimi / DeepSeek-V3 style) as one Triton kernel. Contract: kernels/moe/naive.py.

One program routes BLOCK_T tokens over all E experts: sigmoid, + correction bias (selection only), top-k by
k rounds of argmax, gather the unbiased scores (one reduction for all k), renormalise, scale. Replaces ~7 small
torch kernels (sigmoid, add, topk, gather, sum, div, mul); bench/gpu_kernels_check.py times both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_kwargs
from kernels.triton_utils import check_device, next_pow2


@triton.jit
def route_rows(
    LOGITS,  # [T, E], or [SPLITS, T, E] partial sums (kernels/moe/router.py), added here in split order
    BIAS,  # [E]
    W_OUT,  # [T, K] fp32
    ID_OUT,  # [T, K] int64
    i_t,
    T,
    E,
    stride_l,
    stride_s,
    scaling,
    extra_id,
    TOP_K: tl.constexpr,
    OUT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CACHE: tl.constexpr,
):
    """Route the BLOCK_T tokens of block ``i_t``. CACHE: the logits' load cache modifier (".cg" where other
    programs of the same launch wrote them: kernels/moe/route_fused.py)."""
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = o_t < T
    o_e = tl.arange(0, BLOCK_E)
    m_e = o_e < E
    p_l = LOGITS + o_t[:, None].to(tl.int64) * stride_l + o_e[None, :]
    m_l = m_t[:, None] & m_e[None, :]
    b_l = tl.load(p_l, mask=m_l, other=0.0, cache_modifier=CACHE).to(tl.float32)
    for s in tl.static_range(1, SPLITS):
        b_l += tl.load(p_l + s * stride_s, mask=m_l, other=0.0, cache_modifier=CACHE).to(tl.float32)
    b_s = tl.sigmoid(b_l)
    if HAS_BIAS:
        b_choice = b_s + tl.load(BIAS + o_e, mask=m_e, other=0.0).to(tl.float32)[None, :]
    else:
        b_choice = b_s
    b_choice = tl.where(m_e[None, :], b_choice, float("-inf"))
    o_k = tl.arange(0, BLOCK_K)
    b_id = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):  # the rounds are serial: one reduction each, nothing more
        b_idx = tl.argmax(b_choice, 1)  # [BLOCK_T]
        b_id = tl.where(o_k[None, :] == j, b_idx[:, None], b_id)
        b_choice = tl.where(o_e[None, :] == b_idx[:, None], float("-inf"), b_choice)
    # the picks' unbiased scores in one reduction after the rounds (a sum of one score and zeros: exact)
    m_pick = (o_k < TOP_K)[None, :, None] & (o_e[None, None, :] == b_id[:, :, None])
    b_w = tl.sum(tl.where(m_pick, b_s[:, None, :], 0.0), 2)
    if RENORM:
        b_w = b_w / (tl.sum(b_w, 1)[:, None] + 1e-20)
    b_w = b_w * scaling
    if OUT_K > TOP_K:  # one more pair a token: (extra_id, 1.0), the shared expert as a routed one
        b_w = tl.where(o_k[None, :] == TOP_K, 1.0, b_w)
        b_id = tl.where(o_k[None, :] == TOP_K, extra_id, b_id)
    m_o = m_t[:, None] & (o_k < OUT_K)[None, :]
    o_out = o_t[:, None].to(tl.int64) * OUT_K + o_k[None, :]
    tl.store(W_OUT + o_out, b_w, mask=m_o)
    tl.store(ID_OUT + o_out, b_id.to(tl.int64), mask=m_o)
    return b_id  # [BLOCK_T, BLOCK_K] int32, as stored: a caller of the same program may use it without a reload


@triton.jit
def _sigmoid_topk_kernel(
    LOGITS,
    BIAS,
    W_OUT,
    ID_OUT,
    T,
    E,
    stride_l,
    stride_s,
    scaling,
    extra_id,
    TOP_K: tl.constexpr,
    OUT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    route_rows(
        LOGITS, BIAS, W_OUT, ID_OUT, tl.program_id(0), T, E, stride_l, stride_s, scaling, extra_id,
        TOP_K, OUT_K, HAS_BIAS, RENORM, SPLITS, BLOCK_T, BLOCK_E, BLOCK_K, "",
    )  # fmt: skip


def check_route_args(e: int, top_k: int, correction_bias: torch.Tensor | None, extra_expert: int | None) -> None:
    """The routing arguments for E experts: 1 <= top_k <= E, a bias of [E], an extra expert past the E."""
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in [1, {e}], got {top_k}")
    if correction_bias is not None and correction_bias.shape != (e,):
        raise ValueError(f"correction_bias must be [{e}], got {tuple(correction_bias.shape)}")
    if extra_expert is not None and extra_expert < e:
        raise ValueError(f"extra_expert must be past the {e} routed experts, got {extra_expert}")


def route_tiles(t: int, e: int, out_k: int, block_t: int | None = None) -> dict[str, int]:
    """``route_rows``' blocks for T tokens over E experts writing ``out_k`` pairs a token. Few tokens a block: the
    k argmax rounds are serial in a program (H200, kernel time, E=256: T=64 3.6 us at 2 tokens vs 11.4 at 16;
    T=4096 12.6 us at 4 vs 14.4 at 16; bench/gpu_kernels_check.py)."""
    block_e = next_pow2(e)
    # one token (a batch-1 step) in a block of one: the rounds' reductions over half the elements
    block_t = block_t or max(1, min(1 if t == 1 else 2 if t <= 1024 else 4, 4096 // block_e))
    return {"BLOCK_T": block_t, "BLOCK_E": block_e, "BLOCK_K": next_pow2(out_k)}


def sigmoid_topk_route_triton(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    scaling_factor: float,
    block_t: int | None = None,
    extra_expert: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (any float dtype; math in fp32), or [S, T, E] fp32 partial sums
    (kernels/moe/router.py: added in split order) -> (weights [T, k] fp32, expert ids [T, k] int64).

    Same result as ``naive.sigmoid_topk_route`` up to the order of the k picks (the reference's topk is
    unsorted; here they come out best first). Ties pick the lower expert id.
    extra_expert: one more column, (extra_expert, 1.0) for every token (the shared expert folded into the
    routed experts' kernels): [T, k + 1] written by the same launch.
    """
    check_device("sigmoid_topk_route_triton", router_logits)
    if router_logits.ndim not in (2, 3) or router_logits.stride(-1) != 1:
        raise ValueError(
            "router_logits must be [T, E] or [S, T, E] partials with a unit stride on E, "
            f"got {tuple(router_logits.shape)}"
        )
    splits = router_logits.shape[0] if router_logits.ndim == 3 else 1
    if splits == 0:
        raise ValueError("router_logits partials need at least one split")
    t, e = router_logits.shape[-2:]
    check_route_args(e, top_k, correction_bias, extra_expert)
    out_k = top_k + (extra_expert is not None)
    weights = torch.empty(t, out_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, out_k, dtype=torch.int64, device=router_logits.device)
    if t == 0:
        return weights, ids
    tiles = route_tiles(t, e, out_k, block_t)
    _sigmoid_topk_kernel[(triton.cdiv(t, tiles["BLOCK_T"]),)](
        router_logits,
        correction_bias.contiguous() if correction_bias is not None else router_logits,
        weights,
        ids,
        t,
        e,
        router_logits.stride(-2),
        router_logits.stride(0) if splits > 1 else 0,
        float(scaling_factor),
        -1 if extra_expert is None else int(extra_expert),
        TOP_K=top_k,
        OUT_K=out_k,
        HAS_BIAS=correction_bias is not None,
        RENORM=renormalize,
        SPLITS=splits,
        **tiles,
        num_warps=4,
        **pdl_kwargs(weights, "moe.route"),
    )
    return weights, ids


__all__ = ["check_route_args", "route_rows", "route_tiles", "sigmoid_topk_route_triton"]
