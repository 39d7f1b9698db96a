"""A KDA layer's input projection and its short conv (with the up-projections) in one launch, at one token.

Why: a batch-1 decode step ran them as two launches a KDA layer, the one-row GEMV of in_proj (12,576 rows, 393
programs) then the conv (``short_conv_update`` with ``low_rank``: 2 x 48 programs, ~3.4 us), and on the H200 a
launch boundary in this chain costs ~3 us (the routing moved inside the MoE gate-up launch: -19 to -24 us for
seven, docs/PERFORMANCE.md, thirty-sixth session). Here the conv's programs come after the projection's in one
grid (at Kimi's shape 393 GEMV programs, then 48 conv channel blocks and 128 up-projection blocks): each
projection program stores its rows, then counts itself (a release atomic after a barrier); each conv
program polls the count until every projection program is counted, acquires, and runs the conv program it is
(``short_conv_program``: reading the projection's output past L1, since other SMs wrote it). The last conv
program to finish puts both counters back to 0 for the next launch.

Waiting inside a launch is safe only because a grid's blocks are dispatched in order of their index (as the
routing inside the MoE gate-up launch assumes, kernels/moe/route_gate_up.py): every projection program is
resident or done before any conv program starts to wait, so no waiter holds a slot a projection program needs.
Under ``TRITON_INTERPRET=1`` programs run one by one in that order.

Measured (an H100, forty-first session, docs/PERFORMANCE.md): the same bits as the two launches across graph
replays, but a b1 step's kernels took 8-14 us longer with it (6 launches fewer saved ~2 us of gaps inside the
graph). The conv cannot start before every projection program is in, so nothing overlaps that did not before; the
likely cost is ~176 programs polling the word the projection's programs count into (untraced). Off
(``TANDEM_KDA_IN_PROJ_CONV=1`` for A / B runs on the H200, not yet timed there).

The bits are the two launches': the projection is ``one_row_block`` (the GEMV's own one-row body, the same tile),
the conv is the conv's own program. Contract: ``gemv`` then ``short_conv_update``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.env import env_switch
from kernels.gemv.triton import gemv_tile, one_row_block
from kernels.short_conv.low_rank import LowRankUp
from kernels.short_conv.program import short_conv_program
from kernels.short_conv.triton import conv_launch, default_tiles
from kernels.triton_utils import check_device, next_pow2

SYNC_WORDS = 2
"""The launch's counters: projection programs done, conv programs done (both 0 between launches)."""
LOW_RANK_MAX_BLOCK_C = 64
"""The up-projections' channels a program here: one launch has one register count, and the conv launch's own 256
(255 registers with spills at Kimi's shape, ptxas sm_90a) would take the GEMV's 393 programs from three an SM
(168 registers) to two, 1.5 waves; at 64 the launch needs the GEMV's 168."""


@triton.jit
def _in_proj_conv_kernel(
    XIN, WIN, PACKED, N_IN, K_IN, stride_win, SYNC, N_PROJ, C_BLOCKS,  # C_BLOCKS: the conv's channel blocks
    X, Y, STATE, W, SLOTS, QSL, ACC, INIT, C, S, stride_x_t, stride_y_t, stride_y_plane, PLANE_C, stride_st_n,
    stride_st_c, stride_w_c, T_CHUNK, N_CHUNKS, LR_A, LR_B, LR_OUT, LR_T, LR_P, LR_K, LR_BLOCKS, stride_lr_a_t,
    stride_lr_a_j, stride_lr_b_j, stride_lr_b_c,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    KW: tl.constexpr, SPEC: tl.constexpr, HAS_ACC: tl.constexpr, CONV: tl.constexpr, WRITE_STATE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, LOW_RANK: tl.constexpr,
    LR_BLOCK_C: tl.constexpr, LR_BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if pid < N_PROJ:
        one_row_block(XIN, WIN, PACKED, pid, N_IN, K_IN, stride_win, BLOCK_N, BLOCK_K, EVEN_K)
        tl.debug_barrier()  # every thread's stores of its rows before the count's release
        tl.atomic_add(SYNC, 1, sem="release", scope="gpu")
    else:
        # the conv's channel blocks of the token, then the up-projections' blocks: no idle programs
        q = pid - N_PROJ
        i_n = (q >= C_BLOCKS).to(tl.int32)
        while tl.load(SYNC, volatile=True) < N_PROJ:
            pass
        tl.atomic_add(SYNC, 0, sem="acquire", scope="gpu")  # orders this program's loads after every count
        tl.debug_barrier()
        short_conv_program(
            X, Y, STATE, W, SLOTS, QSL, ACC, INIT, C, S, stride_x_t, stride_y_t, stride_y_plane, PLANE_C,
            stride_st_n, stride_st_c, stride_w_c, T_CHUNK, N_CHUNKS, LR_A, LR_B, LR_OUT, LR_T, LR_P, LR_K,
            LR_BLOCKS, stride_lr_a_t, stride_lr_a_j, stride_lr_b_j, stride_lr_b_c, KW, SPEC, HAS_ACC, CONV,
            WRITE_STATE, BLOCK_C, BLOCK_T, BLOCK_S, LOW_RANK, LR_BLOCK_C, LR_BLOCK_K, DOT_F32, PREC,
            i_n, q - i_n * C_BLOCKS, 0, 2, ".cg",
        )  # fmt: skip
        tl.debug_barrier()  # every thread is past its poll before the counters can go back
        done = tl.atomic_add(SYNC + 1, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - N_PROJ - 1:  # the last conv program: no one polls SYNC any more
            tl.atomic_xchg(SYNC, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(SYNC + 1, 0, sem="relaxed", scope="gpu")


def in_proj_conv_fits(n: int, k: int, conv_channels: int) -> bool:
    """Whether in_proj [n, k]'s one-row GEMV tile and the conv's tile over conv_channels share a warp count (one
    launch has one; a ``TANDEM_GEMV_ONE_ROW_TILES`` override may give the GEMV another)."""
    return gemv_tile(1, n, k).num_warps == default_tiles(1, conv_channels).num_warps


def in_proj_conv_from_env() -> bool:
    """``TANDEM_KDA_IN_PROJ_CONV``: "1" runs a one-token KDA layer's in_proj and conv in one launch, "0" (the
    default: slower on the H100, untimed on the H200) in two."""
    return env_switch("TANDEM_KDA_IN_PROJ_CONV", False)


def in_proj_conv(
    x: torch.Tensor,
    w_in: torch.Tensor,
    conv_channels: int,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    slot: torch.Tensor,
    fg_b: torch.Tensor,
    sync: torch.Tensor,
    planes: int = 3,
    query_start_loc: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token x [1, K] through in_proj w_in [N, K] (N = C + 2 * r + rest: the conv's C channels, then f_a | g_a
    of rank r, then what follows, e.g. beta's logits), then the short conv of the first C columns into planes
    (``short_conv_update(..., planes=planes)``, reading and updating ``conv_state[slot]``; slot: an int32 [1] on
    the device, -1 skips the conv) with f_a | g_a through fg_b [2, P, r] -> (in_proj's output [1, N], the conv's
    output [planes, 1, C / planes], the up-projections [2, 1, P]). sync: an int32 [``SYNC_WORDS``] at 0, left at 0;
    launches that share it must not overlap (one stream). query_start_loc [2] / has_initial_state [1]: the step's
    int32 rows where it has them on the device (None: [0, 1] / [1], a decode token)."""
    check_device("in_proj_conv", x, w_in, conv_weight, conv_state, slot, fg_b, sync)
    n, k = w_in.shape
    if x.shape != (1, k) or x.dtype != w_in.dtype or x.stride(1) != 1 or w_in.stride(1) != 1:
        raise ValueError(f"in_proj_conv: x [1, {k}] of w_in's dtype {w_in.dtype} and unit column strides, got "
                         f"x {x.dtype} {tuple(x.shape)}")  # fmt: skip
    if fg_b.ndim != 3 or fg_b.shape[0] != 2 or fg_b.stride(2) != 1 or fg_b.dtype != x.dtype:
        raise ValueError(f"in_proj_conv: fg_b must be [2, P, r] of x's dtype with a unit stride on r, got "
                         f"{fg_b.dtype} {tuple(fg_b.shape)}")  # fmt: skip
    r = fg_b.shape[2]
    if conv_channels + 2 * r > n or conv_weight.shape[0] != conv_channels or conv_state.shape[1] != conv_channels:
        raise ValueError(f"in_proj_conv: {conv_channels} conv channels + 2 x {r} must fit in_proj's {n} rows, and "
                         f"conv_weight / conv_state must have {conv_channels} channels")  # fmt: skip
    if slot.shape != (1,) or slot.dtype != torch.int32:
        raise ValueError(f"in_proj_conv: slot must be an int32 [1], got {slot.dtype} {tuple(slot.shape)}")
    if sync.shape != (SYNC_WORDS,) or sync.dtype != torch.int32:
        raise ValueError(f"in_proj_conv: sync must be an int32 [{SYNC_WORDS}], got {sync.dtype} {tuple(sync.shape)}")
    if conv_channels % planes or conv_state.stride(2) != 1 or conv_weight.stride(1) != 1:
        raise ValueError(f"in_proj_conv: {planes} planes must divide {conv_channels} channels; conv_state and "
                         f"conv_weight need a unit last stride")  # fmt: skip
    packed = torch.empty(1, n, dtype=x.dtype, device=x.device)
    qkv, fg_a = packed[:, :conv_channels], packed[:, conv_channels : conv_channels + 2 * r].view(1, 2, r)
    y = packed.new_empty(planes, 1, conv_channels // planes)
    up = packed.new_empty(2, 1, fg_b.shape[1])
    qsl, init = query_start_loc, has_initial_state
    if qsl is None or init is None:  # a launch of its own on CUDA: the engine passes its step's rows
        rows = torch.arange(2, dtype=torch.int32, device=x.device)  # query_start_loc of one token: [0, 1]
        qsl, init = (rows if qsl is None else qsl), (rows[1:] if init is None else init)
    if qsl.shape != (2,) or init.shape != (1,) or qsl.dtype != torch.int32 or init.dtype != torch.int32:
        raise ValueError("in_proj_conv: query_start_loc / has_initial_state must be int32 [2] / [1]")
    launch = conv_launch(
        qkv, y, conv_weight, conv_state, slot, qsl, slot, init, False, False, default_tiles(1, conv_channels),
        1, planes, LowRankUp(fg_a, fg_b, up, LOW_RANK_MAX_BLOCK_C),
    )  # fmt: skip
    tile = gemv_tile(1, n, k)
    block_k = min(tile.block_k, max(16, next_pow2(k)))
    if not in_proj_conv_fits(n, k, conv_channels):
        raise ValueError(f"in_proj_conv: the GEMV tile's {tile.num_warps} warps differ from the conv's "
                         f"{launch.meta['num_warps']} (one launch, one warp count)")  # fmt: skip
    n_proj = triton.cdiv(n, tile.block_n)
    lr_blocks = launch.lr_args[6]  # LR_BLOCKS
    _in_proj_conv_kernel[(n_proj + launch.c_blocks + lr_blocks,)](
        x, w_in, packed, n, k, w_in.stride(0), sync, n_proj, launch.c_blocks,
        *launch.args, launch.t_chunk, launch.n_chunks, *launch.lr_args,
        BLOCK_N=tile.block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, CONV=True, WRITE_STATE=True,
        **launch.meta, **launch.lr_meta, num_stages=tile.num_stages,
    )  # fmt: skip
    return packed, y, up


__all__ = ["SYNC_WORDS", "in_proj_conv", "in_proj_conv_fits", "in_proj_conv_from_env"]
