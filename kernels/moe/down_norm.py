"""A one-token MoE's down GEMM with the combine, the residual add and the next norm run by its last program.
Contract: ``moe_experts_decode`` (pair rows) then ``naive_combine_add_norm`` (rows in pair order).

Why: a batch-1 decode step ended each MoE layer with the combine + add + norm as a one-program launch of its own
(``kernels/moe/combine_norm.py``: 3.75 us on the H100, 7 a step, most of it launch ramp for ~40 KB of reads). The
down launch's programs each store their columns of one expert's output; then each takes a ticket (an
``atomic_add``, acquire-release at GPU scope, after a barrier so all its threads' stores precede it), and the
program that draws the last ticket has seen every expert's every column: it runs the combine + add + norm body
(``combine_add_norm_row``, reading the expert outputs past L1: other SMs wrote them) and puts the ticket back to 0
for the next launch — the pattern of kernels/gemv/norm_after.py and kernels/moe/route_fused.py.

The expert outputs are the two-launch path's bits (the same down programs). The combine + add + norm is the same
arithmetic as ``moe_combine_add_norm``, but its row's sum of squares is reduced in the down launch's thread layout
(4 warps at one token, where the separate launch takes 8), so the norm may differ from it by an fp32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe.combine_norm import combine_add_norm_row
from kernels.moe.decode import decode_tiles, down_norm_tiles, down_program, launch_gate_up
from kernels.moe.tiles import GemmTiles
from kernels.pdl import pdl_enter, pdl_kwargs
from kernels.triton_utils import check_device, dot_config, next_pow2


@triton.jit
def _down_combine_norm_kernel(
    A,  # [k, I] silu(gate) * up, pair order
    IDS,  # [k] int64 the token's experts
    W2,  # [E, H, I]
    Y,  # [k, H] expert outputs (scratch), pair order
    RW,  # [1, k] routing weights
    RESIDUAL,  # [1, H]
    NORM_W,  # [H]
    OUT,  # [1, H] the norm's output
    RES_OUT,  # [1, H] residual + the combine's output
    TICKET,  # [1] int32, 0 on entry and on exit
    H,
    INTER,
    eps,
    stride_a,
    stride_we,
    stride_wn,
    stride_y,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= H
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    down_program(
        A, IDS, IDS, IDS, W2, Y, H, INTER, stride_a, stride_we, stride_wn, stride_y,
        BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PREC, False, True,
    )  # fmt: skip
    # every thread's stores of Y come before the ticket's release (the one-thread atomic after the barrier)
    tl.debug_barrier()
    ticket = tl.atomic_add(TICKET, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:  # the last program: every expert output is stored
        tl.debug_barrier()
        combine_add_norm_row(
            Y, IDS, RW, RESIDUAL, NORM_W, OUT, RES_OUT, 0, H, eps, stride_y, 0, 0, 0, TOP_K, True, BLOCK_H, ".cg"
        )
        tl.atomic_xchg(TICKET, 0, sem="relaxed", scope="gpu")  # no program of this launch touches it again


def moe_experts_decode_add_norm(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    ticket: torch.Tensor,
    gate_up: GemmTiles | None = None,
    down: GemmTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token x [1, H] through its k distinct experts ids [k] (w13 [E, 2I, H], w2 [E, H, I]), combined with
    weights [1, k], added to residual [1, H] and normed by norm_weight [H] -> (the norm's output [1, H] in x's
    dtype, the new residual [1, H] in residual's dtype), in two launches. ticket: an int32 [1] at 0 on x's device
    (``kernels.triton_utils.LaunchTicket``), left at 0; launches that share it must not overlap (one stream)."""
    check_device("moe_experts_decode_add_norm", x, w13, w2, ids)
    e, i2, h = w13.shape
    i = i2 // 2
    k = ids.numel()
    if x.shape != (1, h) or w2.shape != (e, h, i) or ids.shape != (k,) or ids.dtype != torch.int64 or k == 0:
        raise ValueError(
            f"one token x [1, H], w13 [E, 2I, H], w2 [E, H, I], ids [k] int64 (k > 0); got x {tuple(x.shape)}, "
            f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, ids {ids.dtype} {tuple(ids.shape)}"
        )
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("x, w13 and w2 must be contiguous along their last dimension")
    a = torch.empty(k, i, dtype=x.dtype, device=x.device)
    dot_f32, prec = dot_config(x.dtype)
    blocks = dict(DOT_F32=dot_f32, PREC=prec, COMPACT=False, PAIR_ROWS=True)
    launch_gate_up(x, ids, ids, ids, ids, w13, a, k, gate_up or decode_tiles(1)[0], blocks)
    return down_combine_norm(a, ids, w2, weights, residual, norm_weight, eps, ticket, down)


def down_combine_norm(
    a: torch.Tensor,
    ids: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    ticket: torch.Tensor,
    down: GemmTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The down launch of one token's k experts from their silu(gate) * up rows a [k, I] (pair order) -> (the
    norm's output [1, H] in a's dtype, the new residual [1, H]); ids [k] int64 (distinct), the rest as
    ``moe_experts_decode_add_norm`` takes them; down: the launch's tiles (None: ``down_norm_tiles()``)."""
    check_device("down_combine_norm", a, ids, w2, weights, residual, norm_weight, ticket)
    k, i = a.shape
    h = w2.shape[1]
    if w2.shape[2] != i or w2.stride(2) != 1 or ids.shape != (k,) or ids.dtype != torch.int64:
        raise ValueError(f"w2 [E, H, {i}] with a unit stride on I and ids [{k}] int64; got {tuple(w2.shape)}, "
                         f"{ids.dtype} {tuple(ids.shape)}")  # fmt: skip
    if weights.shape != (1, k) or residual.shape != (1, h) or norm_weight.shape != (h,):
        raise ValueError(
            f"weights [1, {k}], residual [1, {h}], norm_weight [{h}]; got {tuple(weights.shape)}, "
            f"{tuple(residual.shape)}, {tuple(norm_weight.shape)}"
        )
    if ticket.shape != (1,) or ticket.dtype != torch.int32:
        raise ValueError(f"ticket must be an int32 [1], got {ticket.dtype} {tuple(ticket.shape)}")
    residual = residual if residual.stride(1) == 1 else residual.contiguous()
    down = down or down_norm_tiles()
    y = torch.empty(k, h, dtype=a.dtype, device=a.device)
    out = torch.empty(1, h, dtype=a.dtype, device=a.device)
    res_out = torch.empty(1, h, dtype=residual.dtype, device=a.device)
    dot_f32, prec = dot_config(a.dtype)
    _down_combine_norm_kernel[(k, triton.cdiv(h, down.block_n))](
        a, ids, w2, y, weights.contiguous(), residual, norm_weight.contiguous(), out, res_out, ticket, h, i,
        float(eps), a.stride(0), w2.stride(0), w2.stride(1), y.stride(0), DOT_F32=dot_f32, PREC=prec,
        BLOCK_M=down.block_m, BLOCK_N=down.block_n, BLOCK_K=down.block_k, TOP_K=k, BLOCK_H=next_pow2(h),
        num_warps=down.num_warps, num_stages=down.num_stages, **pdl_kwargs(a, "moe.down"),
    )  # fmt: skip
    return out, res_out


__all__ = ["down_combine_norm", "moe_experts_decode_add_norm"]
