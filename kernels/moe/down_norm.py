"""A one-token MoE's down GEMM with the combine, the residual add and the next norm run by its last program.
Contract: ``moe_experts_decode`` (pair rows) then ``naive_combine_add_norm`` (rows in pair order).

Why: a batch-1 decode step ended each MoE layer with the combine + add + norm as a one-program launch of its own
(``kernels/moe/combine_norm.py``: 3.75 us on the H100, 7 a step, most of it launch ramp for ~40 KB of reads). The
down launch's programs each store their columns of one expert's output; then each takes a ticket (an
``atomic_add``, acquire-release at GPU scope, after a barrier so all its threads' stores precede it), and the
program that draws the last ticket has seen every expert's every column: it runs the combine + add + norm body
(``combine_add_norm_row``, reading the expert outputs past L1: other SMs wrote them) and puts the ticket back to 0
for the next launch — the pattern of kernels/gemv/norm_after.py and kernels/moe/route_fused.py.

With column-tile tickets (``tile_tickets``, ``TANDEM_MOE_DOWN_TILE_TICKETS=1``) the tail is two levels: each column
tile has a ticket word of its own, and the program that draws its tile's last one (every expert's columns there
are stored) runs that tile's combine + add, storing the fp32 sum; then it takes the launch's ticket, and the last
of those programs only reads the row's fp32 sums back for the norm. Why: the single last program read k rows of
H from L2 and summed them alone after every other program had finished (~4.7 us of the launch on the H200,
thirty-sixth session); the tiles' combines now run in parallel, inside the launch's stream of weights. The bits
are the one-level form's: each column's sum is the same arithmetic, and the norm reduces the same fp32 values in
the same layout.

The expert outputs are the two-launch path's bits (the same down programs). The combine + add + norm is the same
arithmetic as ``moe_combine_add_norm``, but its row's sum of squares is reduced in the down launch's thread layout
(4 warps at one token, where the separate launch takes 8), so the norm may differ from it by an fp32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.env import env_switch
from kernels.moe.combine_norm import combine_add_cols, combine_add_norm_row, norm_row
from kernels.moe.decode import decode_tiles, down_norm_tiles, down_program, launch_gate_up
from kernels.moe.tiles import GemmTiles
from kernels.pdl import pdl_enter, pdl_kwargs
from kernels.triton_utils import check_device, dot_config, next_pow2

TICKET_LINE_WORDS = 32
"""int32 words between two column tiles' ticket words (and the launch's): one 128-byte line each, so the tiles'
atomics do not queue on one L2 line (37 words at Kimi's shape would share two)."""
TILE_WORD_STRIDE: tl.constexpr = tl.constexpr(TICKET_LINE_WORDS)
DOWN_NORM_TICKET_WORDS = (1 + 256) * TICKET_LINE_WORDS  # the launch's line + one a column tile (H <= 256 x BLOCK_N)


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
    TICKET,  # int32 [1] (TILE_TICKETS: [(1 + column tiles) x TICKET_LINE_WORDS]), 0 on entry and on exit
    XSUM,  # [H] fp32 scratch: residual + the combine's output (TILE_TICKETS)
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
    TILE_TICKETS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    down_program(
        A, IDS, IDS, IDS, W2, Y, H, INTER, stride_a, stride_we, stride_wn, stride_y,
        BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PREC, False, True,
    )  # fmt: skip
    # every thread's stores of Y come before the ticket's release (the one-thread atomic after the barrier)
    tl.debug_barrier()
    if TILE_TICKETS:
        _tile_combine_then_norm(
            Y, RW, RESIDUAL, NORM_W, OUT, RES_OUT, TICKET, XSUM, H, eps, stride_y, BLOCK_N, TOP_K, BLOCK_H
        )
    else:
        ticket = tl.atomic_add(TICKET, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:  # the last program: every expert output is stored
            tl.debug_barrier()
            combine_add_norm_row(
                Y, IDS, RW, RESIDUAL, NORM_W, OUT, RES_OUT, 0, H, eps, stride_y, 0, 0, 0, TOP_K, True, BLOCK_H, ".cg"
            )
            tl.atomic_xchg(TICKET, 0, sem="relaxed", scope="gpu")  # no program of this launch touches it again


@triton.jit
def _tile_combine_then_norm(
    Y, RW, RESIDUAL, NORM_W, OUT, RES_OUT, TICKET, XSUM, H, eps, stride_y,
    BLOCK_N: tl.constexpr, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """The two-level tail: this column tile's last program combines + adds its columns (``combine_add_cols``, as
    ``combine_add_norm_row`` does for the whole row), the last such program norms the row from the fp32 sums
    (``norm_row``)."""
    i_n = tl.program_id(1)
    tile_ticket = tl.atomic_add(TICKET + (1 + i_n) * TILE_WORD_STRIDE, 1, sem="acq_rel", scope="gpu")
    if tile_ticket == tl.num_programs(0) - 1:  # every expert's columns of this tile are stored
        tl.debug_barrier()
        cols = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m = cols < H
        x = combine_add_cols(Y, RW, RW, RESIDUAL, OUT, RES_OUT, 0, cols, m, stride_y, 0, 0, TOP_K, True, ".cg")
        tl.store(XSUM + cols, x, mask=m)
        tl.atomic_xchg(TICKET + (1 + i_n) * TILE_WORD_STRIDE, 0, sem="relaxed", scope="gpu")  # all past it
        tl.debug_barrier()  # every thread's stores of XSUM before the release
        ticket = tl.atomic_add(TICKET, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(1) - 1:  # every tile's sums are stored
            tl.debug_barrier()
            cols_h = tl.arange(0, BLOCK_H)
            m_h = cols_h < H
            xh = tl.load(XSUM + cols_h, mask=m_h, other=0.0, cache_modifier=".cg")
            norm_row(xh, m_h, NORM_W, OUT, 0, cols_h, H, eps, 0)
            tl.atomic_xchg(TICKET, 0, sem="relaxed", scope="gpu")


def tile_tickets_from_env() -> bool:
    """``TANDEM_MOE_DOWN_TILE_TICKETS``: "1" runs the two-level tail, "0" (the default) the one last program."""
    return env_switch("TANDEM_MOE_DOWN_TILE_TICKETS", False)


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
    tile_tickets: bool = False,
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
    return down_combine_norm(a, ids, w2, weights, residual, norm_weight, eps, ticket, down, tile_tickets)


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
    tile_tickets: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The down launch of one token's k experts from their silu(gate) * up rows a [k, I] (pair order) -> (the
    norm's output [1, H] in a's dtype, the new residual [1, H]); ids [k] int64 (distinct), the rest as
    ``moe_experts_decode_add_norm`` takes them; down: the launch's tiles (None: ``down_norm_tiles()``);
    tile_tickets: the two-level tail, which needs a ticket of (1 + cdiv(H, block_n)) x 32 words
    (DOWN_NORM_TICKET_WORDS covers H <= 256 x block_n)."""
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
    down = down or down_norm_tiles()
    words = (1 + triton.cdiv(h, down.block_n)) * TICKET_LINE_WORDS if tile_tickets else 1
    if ticket.ndim != 1 or ticket.numel() < words or ticket.dtype != torch.int32 or not ticket.is_contiguous():
        raise ValueError(f"ticket must be a contiguous int32 [>= {words}], got {ticket.dtype} {tuple(ticket.shape)}")
    residual = residual if residual.stride(1) == 1 else residual.contiguous()
    y = torch.empty(k, h, dtype=a.dtype, device=a.device)
    out = torch.empty(1, h, dtype=a.dtype, device=a.device)
    res_out = torch.empty(1, h, dtype=residual.dtype, device=a.device)
    xsum = torch.empty(h if tile_tickets else 1, dtype=torch.float32, device=a.device)
    dot_f32, prec = dot_config(a.dtype)
    _down_combine_norm_kernel[(k, triton.cdiv(h, down.block_n))](
        a, ids, w2, y, weights.contiguous(), residual, norm_weight.contiguous(), out, res_out, ticket, xsum, h, i,
        float(eps), a.stride(0), w2.stride(0), w2.stride(1), y.stride(0), DOT_F32=dot_f32, PREC=prec,
        BLOCK_M=down.block_m, BLOCK_N=down.block_n, BLOCK_K=down.block_k, TOP_K=k, BLOCK_H=next_pow2(h),
        TILE_TICKETS=tile_tickets, num_warps=down.num_warps, num_stages=down.num_stages, **pdl_kwargs(a, "moe.down"),
    )  # fmt: skip
    return out, res_out


__all__ = ["DOWN_NORM_TICKET_WORDS", "down_combine_norm", "moe_experts_decode_add_norm", "tile_tickets_from_env"]
