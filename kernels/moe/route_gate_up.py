"""A one-token MoE layer's routing and its experts' gate-up GEMM in one launch. Contract: ``router_route`` then
``moe_experts_decode``'s gate-up (pair rows), bit for bit: the same program bodies on the same data.

Why: a batch-1 decode step routed each MoE layer in a launch of its own (``route_fused.py``: 8.9 us on the H100
for 1.2 MB of router weights, 7 a step) before the gate-up launch could start. Here one grid holds both: its
first programs are the router's split-K programs (``router_block``); each takes a ticket once its partials are
stored, and the last one routes the row (``route_rows``) and raises a flag (release). The gate-up programs come
after them: the shared expert's first (its id is known on the host, so it streams its weights while the router
runs), then the routed slots', which wait for the flag (acquire) and read their expert from the routing.

Waiting inside a launch is safe only if the programs waited on are not held back by the waiters. The router's
programs never wait and come first in the grid: the GPU dispatches a grid's blocks in order of their linear
index (what CUB's single-pass scan and CUTLASS's stream-K fix-up also rely on), so they are running or done
before any waiter holds an SM.

The whole block in one launch (``route_gate_up_down_norm``, ``TANDEM_MOE_BLOCK_ONE_LAUNCH=1``; off: slower, 70 us
against 59 us in two launches on an H100, docs/PERFORMANCE.md, thirty-eighth session): the down programs (a slot x
a block of H's columns, ``block_down.py``) come after every gate-up program. Each gate-up program counts its slot
once its rows of A are stored (release); a slot's down programs wait for the count to reach the slot's column
blocks (acquire), read A past L1 and stream their expert's down rows, the shared expert's first: its rows need no
routing, so its down weights could stream while the router runs. The last down program runs the combine +
residual add + next norm (``combine_add_norm_row``), as ``down_combine_norm``'s does. The down launch's ramp leaves
the step, and a slot's down starts when its rows are ready, not when every slot's are. (Measured, every slot's
gate-up programs run side by side and finish together, so the down programs gain no overlap and hold their SMs
while they wait.)

How a routed program learns its expert, two ways (``slot_words``):
- the flag (the default: the faster form in a decode step, docs/PERFORMANCE.md, thirty-seventh session): the
  routing's last program raises one flag (release); a waiter polls it, then an acquire, a barrier and a load of
  its expert id from the routing's output, and counts itself before its weights stream; the last one counted puts
  the flag and the count back to 0 (with ``TANDEM_MOE_ROUTE_ACQUIRE_POLL=1`` every thread polls with an acquire
  load and the count comes after the rows: one round trip after the flag instead of three, ``flag_wait.py``);
- the slot words (``slot_words=True``, ``TANDEM_MOE_ROUTE_SLOT_WORDS=1``; off: on an H100 3 us faster than the
  flag alone, yet 1.3 us a layer slower in a b1 step, where other launches run around it): the routing's last
  program writes each routed slot's expert id + 1 into a word of its own (0: not yet) straight from its registers
  (``route_rows`` returns the ids it stored), so the poll that sees it non-zero has the expert: no acquire and no
  second load before the weights stream (the gate-up programs read nothing else the routing writes; the down
  launch reads the weights after this launch ends). Each routed program counts itself once its rows are stored,
  off the path to its first weight load; the last one puts the words and the count back to 0.
``SYNC`` is ``SYNC_SIZE`` int32 on the device (``LaunchTicket(SYNC_SIZE)``): the router's ticket, the routed
programs' count, the flag, a word a routed slot; 0 before a launch and after it; launches that share it must not
overlap (one stream).

Session 35's "hang" of this launch was a fresh machine's cold Triton cache (docs/PERFORMANCE.md, session 36).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe.block_down import DownNorm, block_down_program, wait_options
from kernels.moe.decode import decode_tiles, gate_up_rows, launch_gate_up
from kernels.moe.flag_wait import acquire_poll, wait_flag
from kernels.moe.route_fused import router_route
from kernels.moe.router import BLOCK_E, SPLIT_K, check_router_args, router_block, router_tiles
from kernels.moe.tiles import GemmTiles
from kernels.moe.triton import check_route_args, route_rows, route_tiles
from kernels.pdl import pdl_enter, pdl_kwargs
from kernels.triton_utils import check_device, dot_config, next_pow2

MAX_ROUTED = 16
"""Routed experts a token at most with ``slot_words``: one word each in ``SYNC``."""
DOWN_TICKET = 3 + MAX_ROUTED
SLOT_DONE = DOWN_TICKET + 1
SYNC_SIZE = SLOT_DONE + MAX_ROUTED + 1
"""int32 words of a launch's counters: the router's ticket, the routed programs' count, the flag, a routed slot's
word (``slot_words``), then the down programs' ticket and a count of each slot's finished gate-up programs (the
down programs in the launch, ``route_gate_up_down_norm``)."""


@triton.jit
def write_slot_words(SYNC, ids, TOP_K: tl.constexpr, ROUTE_BLOCK_T: tl.constexpr, ROUTE_BLOCK_K: tl.constexpr,
                     SEM: tl.constexpr):  # fmt: skip
    """Each routed slot's expert + 1 into its word of ``SYNC``, straight from the routing's registers (``ids``, row 0
    of its block): no store read back."""
    o_k = tl.arange(0, ROUTE_BLOCK_K)
    m_w = (tl.arange(0, ROUTE_BLOCK_T) == 0)[:, None] & (o_k < TOP_K)[None, :]
    words = SYNC + 3 + tl.zeros([ROUTE_BLOCK_T, ROUTE_BLOCK_K], dtype=tl.int32) + o_k[None, :]
    tl.atomic_xchg(words, ids + 1, mask=m_w, sem=SEM, scope="gpu")


@triton.jit
def _route_gate_up_kernel(
    X,  # [1, H] the token's normed hidden
    RW,  # [E, H] the router's weight
    P,  # [S, 1, E] fp32 partials (scratch)
    SYNC,  # [SYNC_SIZE] int32: the router's ticket, the routed programs' count, the flag, a slot's expert id + 1
    BIAS,  # [E]
    W_OUT,  # [1, OUT_K] fp32
    ID_OUT,  # [1, OUT_K] int64
    W13,  # [E (+1), 2I, H]
    A,  # [OUT_K, I] out: silu(gate) * up, pair order
    W2,  # [E (+1), H, I] (WITH_DOWN, as the rest of this block)
    Y,  # [OUT_K, H] expert outputs (scratch), pair order
    RESIDUAL,  # [1, H]
    NORM_W,  # [H]
    OUT,  # [1, H] the next norm's output
    RES_OUT,  # [1, H] residual + the combine's output
    E,
    H,
    INTER,
    stride_x,
    stride_rw,
    scaling,
    extra_id,
    up_offset,
    stride_we,
    stride_wn,
    stride_a,
    stride_w2e,
    stride_w2n,
    stride_y,
    eps,
    N_ROUTER: tl.constexpr,  # the router's programs: expert blocks x splits
    E_BLOCKS: tl.constexpr,
    N_COLS: tl.constexpr,  # column blocks of I a slot
    SPLIT: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_KR: tl.constexpr,  # the router's K step
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,  # next power of two >= TOP_K
    OUT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    ROUTE_BLOCK_T: tl.constexpr,
    ROUTE_BLOCK_E: tl.constexpr,
    ROUTE_BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    SLOT_WORDS: tl.constexpr,  # each routed slot polls a word holding its expert, not the flag
    ACQUIRE_POLL: tl.constexpr,  # the flag polled with acquire loads, the count after the rows (flag_wait.py)
    WITH_DOWN: tl.constexpr,  # the down programs after the gate-up's, the combine + norm by the last of them
    N_DCOLS: tl.constexpr,  # column blocks of H a slot's down
    OUT_SLOTS: tl.constexpr,  # next power of two >= OUT_K
    BLOCK_H: tl.constexpr,  # >= H
    DOWN_TICKET: tl.constexpr,  # SYNC's words of the down programs (the module's constants)
    SLOT_DONE: tl.constexpr,
    POLL_NS: tl.constexpr,  # the down programs' sleep between polls (block_down.py)
    PREFETCH_LANES: tl.constexpr,  # > 0: the down programs ask their rows into L2 before they wait
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    routed = TOP_K * N_COLS  # the routed slots' programs
    if pid < N_ROUTER:
        router_block(
            X, RW, P, pid % E_BLOCKS, pid // E_BLOCKS, 1, E, H, stride_x, stride_rw,
            SPLIT, BLOCK_T, BLOCK_E, BLOCK_KR, DOT_F32, PREC,
        )  # fmt: skip
        # every thread's partial stores come before the ticket's release (the one-thread atomic after the barrier)
        tl.debug_barrier()
        ticket = tl.atomic_add(SYNC, 1, sem="acq_rel", scope="gpu")
        if ticket == N_ROUTER - 1:  # the last router program: every partial is stored
            tl.debug_barrier()
            ids = route_rows(
                P, BIAS, W_OUT, ID_OUT, 0, 1, E, E, E, scaling, extra_id,
                TOP_K, OUT_K, HAS_BIAS, RENORM, SPLITS, ROUTE_BLOCK_T, ROUTE_BLOCK_E, ROUTE_BLOCK_K, ".cg",
            )  # fmt: skip
            if SLOT_WORDS:
                tl.atomic_xchg(SYNC, 0, sem="relaxed", scope="gpu")
                write_slot_words(SYNC, ids, TOP_K, ROUTE_BLOCK_T, ROUTE_BLOCK_K, "release")
            else:
                if PREFETCH_LANES > 0:  # the down programs' early copy of each routed slot's expert (block_down.py)
                    write_slot_words(SYNC, ids, TOP_K, ROUTE_BLOCK_T, ROUTE_BLOCK_K, "relaxed")
                tl.debug_barrier()  # the routing's stores before the flag's release
                tl.atomic_xchg(SYNC, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(SYNC + 2, 1, sem="release", scope="gpu")
    elif pid < N_ROUTER + OUT_K * N_COLS:
        g = pid - N_ROUTER
        slot = (g // N_COLS + OUT_K - 1) % OUT_K if OUT_K > TOP_K else g // N_COLS  # the shared expert's first
        if slot == TOP_K:  # the shared expert: its id is the host's
            e = extra_id.to(tl.int32)
        elif SLOT_WORDS:  # the slot's word is its expert + 1 once routed
            word = tl.load(SYNC + 3 + slot, volatile=True)
            while word == 0:
                word = tl.load(SYNC + 3 + slot, volatile=True)
            e = word - 1
        else:
            wait_flag(SYNC + 2, ACQUIRE_POLL)  # kernels/moe/flag_wait.py
            e = tl.load(ID_OUT + slot, cache_modifier=".cg").to(tl.int32)
            if not ACQUIRE_POLL:
                seen = tl.atomic_add(SYNC + 1, 1, sem="relaxed", scope="gpu")
                if seen == routed - 1:  # every routed program has seen the flag: both back to 0
                    tl.atomic_xchg(SYNC + 2, 0, sem="relaxed", scope="gpu")
                    tl.atomic_xchg(SYNC + 1, 0, sem="relaxed", scope="gpu")
        gate_up_rows(
            X, X, W13, A, e, slot, slot + 1, g % N_COLS, H, INTER, up_offset, stride_x, stride_we, stride_wn,
            stride_a, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PREC, True,
        )  # fmt: skip
        if WITH_DOWN:  # this slot's down programs wait for all N_COLS of these (release: the rows come first)
            tl.debug_barrier()
            tl.atomic_add(SYNC + SLOT_DONE + slot, 1, sem="release", scope="gpu")
        if (SLOT_WORDS or ACQUIRE_POLL) and slot != TOP_K:  # counted after its rows: the last one puts back to 0
            if ACQUIRE_POLL:
                tl.debug_barrier()  # every thread is past its own poll before the flag can go back to 0
            seen = tl.atomic_add(SYNC + 1, 1, sem="relaxed", scope="gpu")
            if seen == routed - 1:
                tl.atomic_xchg(SYNC + 1, 0, sem="relaxed", scope="gpu")
                if SLOT_WORDS:  # the words
                    slots = tl.arange(0, SLOTS)
                    tl.atomic_xchg(SYNC + 3 + slots, 0, mask=slots < TOP_K, sem="relaxed", scope="gpu")
                else:  # the flag
                    tl.atomic_xchg(SYNC + 2, 0, sem="relaxed", scope="gpu")
    elif WITH_DOWN:
        block_down_program(
            pid - N_ROUTER - OUT_K * N_COLS, A, W2, Y, SYNC, ID_OUT, W_OUT, RESIDUAL, NORM_W, OUT, RES_OUT, extra_id,
            H, INTER, stride_a, stride_w2e, stride_w2n, stride_y, eps, N_COLS, N_DCOLS, TOP_K, OUT_K, OUT_SLOTS,
            BLOCK_H, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PREC, DOWN_TICKET, SLOT_DONE, POLL_NS, PREFETCH_LANES,
        )  # fmt: skip


def route_gate_up(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    sync: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    scaling_factor: float,
    w13: torch.Tensor,
    extra_expert: int | None = None,
    gate_up: GemmTiles | None = None,
    split: int = SPLIT_K,
    slot_words: bool = False,
    acquire: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token x [1, H]: ``router_route`` (router_weight [E, H]) and the gate-up of its experts (w13 [E (+1), 2I,
    H]) in one launch -> (weights [1, k (+1)] fp32, ids [1, k (+1)] int64, silu(gate) * up [k (+1), I] in pair
    order: what ``kernels/moe/down_norm.down_combine_norm`` takes). sync: int32 [SYNC_SIZE] at 0
    (``LaunchTicket(SYNC_SIZE)``); slot_words: how the routed programs learn their experts (the module's doc);
    acquire: the flag's waiters poll with acquire loads (``flag_wait.py``; None: the environment's)."""
    _check_args(x, router_weight, sync, correction_bias, top_k, w13, extra_expert, split, slot_words)
    weights, ids, a, _ = _launch(x, router_weight, sync, correction_bias, top_k, renormalize, scaling_factor, w13,
                                 extra_expert, gate_up, split, slot_words, acquire, None)  # fmt: skip
    return weights, ids, a


def route_gate_up_down_norm(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    sync: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    scaling_factor: float,
    w13: torch.Tensor,
    w2: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    extra_expert: int | None = None,
    tiles: GemmTiles | None = None,
    split: int = SPLIT_K,
    poll_ns: int | None = None,
    prefetch: bool | None = None,
    acquire: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole one-token MoE block in one launch: ``route_gate_up`` (the flag form), then each slot's down
    programs (w2 [E (+1), H, I]), which wait inside the launch for that slot's gate-up programs, and the combine +
    residual add + next norm by the last of them -> (the norm's output [1, H] in x's dtype, residual [1, H] + the
    combine's output in the residual's dtype): ``down_combine_norm`` on ``route_gate_up``'s outputs, bit for bit.
    The down programs come after every gate-up program in the grid, so they wait only on programs dispatched
    before them; the shared expert's first, as its rows need no routing. tiles: both GEMMs' (``decode_tiles(1)[0]``,
    the gate-up's: the down programs here take its columns); poll_ns, prefetch: how the down programs wait
    (``block_down.py``), acquire: how the flag's waiters poll (``flag_wait.py``); None: the environment's."""
    _check_args(x, router_weight, sync, correction_bias, top_k, w13, extra_expert, split, True)
    h, i = x.shape[1], w13.shape[1] // 2
    check_device("route_gate_up_down_norm", w2, residual, norm_weight)
    experts = router_weight.shape[0] if extra_expert is None else extra_expert + 1
    if w2.ndim != 3 or w2.shape[1:] != (h, i) or w2.shape[0] < experts or w2.stride(2) != 1 or w2.dtype != x.dtype:
        raise ValueError(
            f"w2 must be [>= {experts}, {h}, {i}] {x.dtype} with a unit stride on I, got {w2.dtype} {tuple(w2.shape)}"
        )
    if residual.shape != (1, h) or norm_weight.shape != (h,):
        raise ValueError(f"residual [1, {h}] and norm_weight [{h}], got {tuple(residual.shape)} and "
                         f"{tuple(norm_weight.shape)}")  # fmt: skip
    down = DownNorm(w2, residual if residual.stride(1) == 1 else residual.contiguous(), norm_weight.contiguous(),
                    float(eps), *wait_options(poll_ns, prefetch, w2))  # fmt: skip
    _, _, _, (out, res_out) = _launch(x, router_weight, sync, correction_bias, top_k, renormalize, scaling_factor,
                                      w13, extra_expert, tiles, split, False, acquire, down)  # fmt: skip
    return out, res_out


def _check_args(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    sync: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    w13: torch.Tensor,
    extra_expert: int | None,
    split: int,
    slot_bound: bool,
) -> None:
    """The launch's arguments; slot_bound: the slot words or the down programs, a word of ``SYNC`` a slot."""
    check_router_args("route_gate_up", x, router_weight, split)
    check_device("route_gate_up", w13, sync)
    e, h = router_weight.shape
    check_route_args(e, top_k, correction_bias, extra_expert)
    if x.shape[0] != 1:
        raise ValueError(f"route_gate_up takes one token, got x {tuple(x.shape)}")
    if w13.ndim != 3 or w13.shape[2] != h or w13.shape[1] % 2 or w13.stride(2) != 1 or x.dtype != w13.dtype:
        raise ValueError(
            f"w13 must be [E, 2I, {h}] {x.dtype} with a unit stride on H, got {w13.dtype} {tuple(w13.shape)}"
        )
    if w13.shape[0] < (e if extra_expert is None else extra_expert + 1):
        raise ValueError(f"w13 holds {w13.shape[0]} experts: too few for {e} routed and extra expert {extra_expert}")
    if slot_bound and top_k > MAX_ROUTED:
        raise ValueError(f"route_gate_up's slot words hold at most {MAX_ROUTED} experts a token, got top_k {top_k}")
    if sync.shape != (SYNC_SIZE,) or sync.dtype != torch.int32:
        raise ValueError(
            f"sync must be an int32 [{SYNC_SIZE}] (LaunchTicket(SYNC_SIZE)), got {sync.dtype} {tuple(sync.shape)}"
        )


def _launch(x, router_weight, sync, correction_bias, top_k, renormalize, scaling_factor, w13, extra_expert, tiles,
            split, slot_words, acquire, down: DownNorm | None):  # fmt: skip
    """One launch of the kernel, its arguments checked -> (weights, ids, a, (the norm's output, the new residual)
    with ``down``, else None)."""
    e, h = router_weight.shape
    i = w13.shape[1] // 2
    out_k = top_k + (extra_expert is not None)
    gu = tiles or decode_tiles(1)[0]
    n_split = triton.cdiv(h, split)
    e_blocks = triton.cdiv(e, BLOCK_E)
    n_cols = triton.cdiv(i, gu.block_n)
    n_dcols = triton.cdiv(h, gu.block_n) if down is not None else 0
    partials = torch.empty(n_split, 1, e, dtype=torch.float32, device=x.device)
    weights = torch.empty(1, out_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(1, out_k, dtype=torch.int64, device=x.device)
    a = torch.empty(out_k, i, dtype=x.dtype, device=x.device)
    if down is not None:
        w2, res, nw, eps = down.w2, down.residual, down.norm_weight, down.eps
        y = torch.empty(out_k, h, dtype=x.dtype, device=x.device)
        outs = (torch.empty(1, h, dtype=x.dtype, device=x.device), torch.empty(1, h, dtype=res.dtype, device=x.device))
    else:  # placeholders, never read
        w2, res, nw, eps, y, outs = a, a, a, 0.0, a, (a, a)
    rt = router_tiles(1, split, x.dtype)
    _route_gate_up_kernel[(e_blocks * n_split + out_k * (n_cols + n_dcols),)](
        x, router_weight, partials, sync, correction_bias.contiguous() if correction_bias is not None else partials,
        weights, ids, w13, a, w2, y, res, nw, outs[0], outs[1], e, h, i, x.stride(0), router_weight.stride(0),
        float(scaling_factor), -1 if extra_expert is None else int(extra_expert), i * w13.stride(1), w13.stride(0),
        w13.stride(1), a.stride(0), w2.stride(0), w2.stride(1), y.stride(0), eps,
        N_ROUTER=e_blocks * n_split, E_BLOCKS=e_blocks, N_COLS=n_cols, SPLIT=split, SPLITS=n_split,
        BLOCK_T=rt["BLOCK_T"], BLOCK_E=rt["BLOCK_E"], BLOCK_KR=rt["BLOCK_K"], TOP_K=top_k,
        SLOTS=triton.next_power_of_2(top_k), OUT_K=out_k,
        HAS_BIAS=correction_bias is not None, RENORM=renormalize,
        **{f"ROUTE_{k}": v for k, v in route_tiles(1, e, out_k).items()}, BLOCK_M=gu.block_m, BLOCK_N=gu.block_n,
        BLOCK_K=gu.block_k, DOT_F32=rt["DOT_F32"], PREC=rt["PREC"], SLOT_WORDS=slot_words,
        ACQUIRE_POLL=not slot_words and acquire_poll(acquire), WITH_DOWN=n_dcols > 0,
        N_DCOLS=max(n_dcols, 1), OUT_SLOTS=triton.next_power_of_2(out_k), BLOCK_H=next_pow2(h) if n_dcols else 1,
        DOWN_TICKET=DOWN_TICKET, SLOT_DONE=SLOT_DONE, POLL_NS=down.poll_ns if down is not None else 0,
        PREFETCH_LANES=32 * gu.num_warps if down is not None and down.prefetch else 0,
        num_warps=gu.num_warps, num_stages=gu.num_stages,
        **pdl_kwargs(x, "moe.router_route"),
    )  # fmt: skip
    return weights, ids, a, (outs if down is not None else None)


def route_then_gate_up(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    ticket: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    scaling_factor: float,
    w13: torch.Tensor,
    extra_expert: int | None = None,
    split: int = SPLIT_K,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contract: the two launches ``route_gate_up`` replaces (``router_route`` with its int32 [1] ticket, then
    the pair-row gate-up at ``decode_tiles(1)``), returning what it returns."""
    weights, ids = router_route(
        x, router_weight, ticket, correction_bias, top_k, renormalize, scaling_factor, extra_expert, split
    )
    flat = ids.reshape(-1)
    a = torch.empty(flat.numel(), w13.shape[1] // 2, dtype=x.dtype, device=x.device)
    dot_f32, prec = dot_config(x.dtype)
    blocks = dict(DOT_F32=dot_f32, PREC=prec, COMPACT=False, PAIR_ROWS=True)
    launch_gate_up(x, flat, flat, flat, flat, w13, a, flat.numel(), decode_tiles(1)[0], blocks)
    return weights, ids, a


__all__ = ["MAX_ROUTED", "SYNC_SIZE", "route_gate_up", "route_gate_up_down_norm", "route_then_gate_up"]
