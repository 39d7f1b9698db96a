"""The MoE router GEMV and its sigmoid top-k in one launch, for steps of a few rows. Contract: the router's logits
(``naive_router_partials`` summed in split order) through ``naive.sigmoid_topk_route``.

A batch-1 decode step routes each MoE layer with two short launches: the router GEMM (1.2 MB of weights, ~5.7 us on
cuBLAS) and the top-k kernel (one program, ~4 us), each mostly launch ramp and one serial tail (the H100 trace of
the twenty-ninth session: 68 us of a 1.17 ms step over 7 layers). Here the split-K router programs
(kernels/moe/router.py: expert block x column split, fp32 partial sums) each take a ticket once their partials are
stored; the program that draws the last ticket has seen every other program's stores (release / acquire on the
ticket), adds the partials in split order and routes the rows (``route_rows``, the top-k kernel's body), then puts
the ticket back to 0 for the next launch — so the result is the unfused pair's bit for bit, in one launch.

The ticket is one int32 on the device that must be 0 before a launch (``RouteTicket``, a ``LaunchTicket``); launches
that share it must not overlap (one stream: the decode step's layers run in order). Rows are routed by one program,
serially, so this is for steps of a few rows (``FUSED_ROUTE_MAX_ROWS`` in engine/backends/gpu_moe.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe.router import BLOCK_E, SPLIT_K, check_router_args, router_block, router_tiles
from kernels.moe.triton import check_route_args, route_rows, route_tiles
from kernels.pdl import pdl_enter, pdl_kwargs
from kernels.triton_utils import LaunchTicket as RouteTicket


@triton.jit
def _router_route_kernel(
    X,  # [T, H]
    W,  # [E, H]
    P,  # [S, T, E] fp32 partials (scratch)
    TICKET,  # [1] int32, 0 on entry and on exit
    BIAS,  # [E]
    W_OUT,  # [T, K] fp32
    ID_OUT,  # [T, K] int64
    T,
    E,
    H,
    stride_x,
    stride_w,
    scaling,
    extra_id,
    SPLIT: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    TOP_K: tl.constexpr,
    OUT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    ROUTE_BLOCK_T: tl.constexpr,
    ROUTE_BLOCK_E: tl.constexpr,
    ROUTE_BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    router_block(
        X, W, P, tl.program_id(0), tl.program_id(1), T, E, H, stride_x, stride_w,
        SPLIT, BLOCK_T, BLOCK_E, BLOCK_K, DOT_F32, PREC,
    )  # fmt: skip
    # every thread's partial stores come before the ticket's release (the one-thread atomic after the barrier)
    tl.debug_barrier()
    ticket = tl.atomic_add(TICKET, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:  # the last program: every partial is stored
        tl.debug_barrier()
        for i_t in range(0, tl.cdiv(T, ROUTE_BLOCK_T)):
            route_rows(
                P, BIAS, W_OUT, ID_OUT, i_t, T, E, E, T * E, scaling, extra_id,
                TOP_K, OUT_K, HAS_BIAS, RENORM, SPLITS, ROUTE_BLOCK_T, ROUTE_BLOCK_E, ROUTE_BLOCK_K, ".cg",
            )  # fmt: skip
        tl.atomic_xchg(TICKET, 0, sem="relaxed", scope="gpu")  # no program of this launch touches it again


def router_route(
    x: torch.Tensor,
    weight: torch.Tensor,
    ticket: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    scaling_factor: float,
    extra_expert: int | None = None,
    split: int = SPLIT_K,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route x [T, H] through the router weight [E, H] in one launch -> (weights [T, k (+1)] fp32, expert ids
    [T, k (+1)] int64): ``sigmoid_topk_route_triton(router_partials(x, weight, split), ...)``, the same adds in the
    same order. ticket: an int32 [1] at 0 (``RouteTicket``), left at 0."""
    check_router_args("router_route", x, weight, split)
    t, h = x.shape
    e = weight.shape[0]
    check_route_args(e, top_k, correction_bias, extra_expert)
    if ticket.shape != (1,) or ticket.dtype != torch.int32 or ticket.device != x.device:
        raise ValueError(f"ticket must be an int32 [1] on {x.device}, got {ticket.dtype} {tuple(ticket.shape)}")
    out_k = top_k + (extra_expert is not None)
    weights = torch.empty(t, out_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, out_k, dtype=torch.int64, device=x.device)
    if t == 0:
        return weights, ids
    n_split = triton.cdiv(h, split)
    partials = torch.empty(n_split, t, e, dtype=torch.float32, device=x.device)
    _router_route_kernel[(triton.cdiv(e, BLOCK_E), n_split)](
        x,
        weight,
        partials,
        ticket,
        correction_bias.contiguous() if correction_bias is not None else partials,
        weights,
        ids,
        t,
        e,
        h,
        x.stride(0),
        weight.stride(0),
        float(scaling_factor),
        -1 if extra_expert is None else int(extra_expert),
        SPLITS=n_split,
        TOP_K=top_k,
        OUT_K=out_k,
        HAS_BIAS=correction_bias is not None,
        RENORM=renormalize,
        **router_tiles(t, split, x.dtype),  # the partials and the route as the two launches take them
        **{f"ROUTE_{k}": v for k, v in route_tiles(t, e, out_k).items()},
        num_warps=4,
        **pdl_kwargs(x, "moe.router_route"),
    )
    return weights, ids


__all__ = ["RouteTicket", "router_route"]
