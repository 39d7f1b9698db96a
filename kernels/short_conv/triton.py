"""Triton short convolution with per-sequence state slots, for prefill chunks, decode and spec verify.

Contracts: kernels/short_conv/naive.py (plain) and kernels/short_conv/naive_spec.py (slot-indexed, with
``num_accepted`` and the spec write). One program owns one (sequence, channel block, token chunk): it reads
the window, walks its chunk's tokens in tiles of BLOCK_T (conv + SiLU, fp32 accumulation).

Short sequences (decode, verify, small chunks) run as one chunk per sequence, and that program also writes
the new state after a barrier, so reading and updating one slot in place is race free in one launch. A long
prefill is cut into chunks of T_CHUNK tokens that run in parallel (one chunk per program would leave most of
the GPU idle: a 32k-token prompt is one sequence); then a second launch of the same kernel writes the states
(STATE_ONLY), ordered after every chunk's reads of the old window by the stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_kwargs
from kernels.short_conv.low_rank import LowRankUp, low_rank_args
from kernels.short_conv.program import short_conv_program
from kernels.triton_utils import check_device, next_pow2
from kernels.upload import upload


@triton.jit
def _short_conv_kernel(
    X,  # [T, C]
    Y,  # [T, C], or [G, T, C/G] planes (PLANE_C channels each)
    STATE,  # [slots, C, S]
    W,  # [C, KW]
    SLOTS,  # [N] int32 (-1: padding, skipped)
    QSL,  # [N + 1] int32
    ACC,  # [N] int32 num_accepted (if HAS_ACC)
    INIT,  # [N] int32 has_initial_state
    C,
    S,
    stride_x_t,
    stride_y_t,
    stride_y_plane,
    PLANE_C,
    stride_st_n,
    stride_st_c,
    stride_w_c,
    T_CHUNK,
    N_CHUNKS,
    LR_A,  # KDA's up-projections (LOW_RANK): kernels/short_conv/low_rank.py
    LR_B,
    LR_OUT,
    LR_T,
    LR_P,
    LR_K,
    LR_BLOCKS,
    stride_lr_a_t,
    stride_lr_a_j,
    stride_lr_b_j,
    stride_lr_b_c,
    KW: tl.constexpr,
    SPEC: tl.constexpr,
    HAS_ACC: tl.constexpr,
    CONV: tl.constexpr,
    WRITE_STATE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    LOW_RANK: tl.constexpr,
    LR_BLOCK_C: tl.constexpr,
    LR_BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    short_conv_program(
        X, Y, STATE, W, SLOTS, QSL, ACC, INIT, C, S, stride_x_t, stride_y_t, stride_y_plane, PLANE_C, stride_st_n,
        stride_st_c, stride_w_c, T_CHUNK, N_CHUNKS, LR_A, LR_B, LR_OUT, LR_T, LR_P, LR_K, LR_BLOCKS, stride_lr_a_t,
        stride_lr_a_j, stride_lr_b_j, stride_lr_b_c, KW, SPEC, HAS_ACC, CONV, WRITE_STATE, BLOCK_C, BLOCK_T, BLOCK_S,
        LOW_RANK, LR_BLOCK_C, LR_BLOCK_K, DOT_F32, PREC,
        tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0), "",
    )  # fmt: skip


@dataclass(frozen=True)
class ConvTiles:
    """Launch parameters: tokens per tile, channels per program, tokens per program of a long sequence
    (chunks run in parallel; see the module docstring), warps."""

    block_t: int
    block_c: int
    t_chunk: int = 256
    num_warps: int = 4


def default_tiles(longest: int, channels: int) -> ConvTiles:
    """16-token tiles of up to 256 channels (4,096 fp32 accumulators), 256 tokens per program."""
    block_t = min(next_pow2(max(longest, 1)), 16)
    return ConvTiles(block_t, max(16, min(next_pow2(channels), 4096 // block_t, 256)))


def _as_int32(x, n: int, device: torch.device, name: str) -> torch.Tensor:
    t = (
        x.to(device=device, dtype=torch.int32)
        if isinstance(x, torch.Tensor)
        else torch.tensor(list(x), dtype=torch.int32)
    )
    if t.shape != (n,):
        raise ValueError(f"{name} must have {n} entries, got {tuple(t.shape)}")
    return upload(t, device)


def short_conv_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    slots: Sequence[int] | torch.Tensor,
    query_start_loc: Sequence[int] | torch.Tensor,
    has_initial_state: Sequence[bool] | torch.Tensor | None = None,
    num_accepted: Sequence[int] | torch.Tensor | None = None,
    spec: bool = False,
    out: torch.Tensor | None = None,
    max_q_len: int | None = None,
    tiles: ConvTiles | None = None,
    planes: int = 1,
    low_rank: LowRankUp | None = None,
) -> torch.Tensor:
    """Depthwise causal conv + SiLU over a varlen batch, reading and updating each sequence's state slot.

    Args:
        x: [T, C] pre-conv inputs of all sequences, concatenated (unit stride on C).
        weight: [C, W] depthwise kernels (W >= 2).
        conv_state: [num_slots, C, S] with S >= W-1 (W-1+num_spec for spec decoding); updated in place.
        slots: [N] state slot of each sequence; -1 marks a padding sequence (skipped, its rows of y untouched).
        query_start_loc: [N+1] row offsets of the sequences in x.
        has_initial_state: [N]; False reads a zero window (a request's first chunk). Default all True.
        num_accepted: [N] accepted tokens of the previous verify step (window at column num_accepted-1);
            None means 1 (column 0, the plain contract).
        spec: use the spec write (x lands at columns W-2..; see naive_spec.py) instead of the plain one.
        max_q_len: longest sequence (tile-size hint when query_start_loc is a device tensor).
        tiles: launch parameters (default: ``default_tiles``; bench/short_conv_sweep.py times others).
        planes: G > 1 writes y as G contiguous planes [G, T, C/G], channel c in plane c // (C/G): Kimi's
            q | k | v come out as three contiguous tensors (fla's KDA kernels take no strided q / k / v, so
            column views of a [T, C] output would each be copied).
        low_rank: KDA's f_b | g_b up-projections, written into ``low_rank.out`` by extra programs of the same
            launch (kernels/short_conv/low_rank.py: one program walks all T rows of its channels, so for
            decode-sized steps).
    Returns: y [T, C] (or [G, T, C/G] with planes=G) in x's dtype.

    With slots/num_accepted as host lists the wrapper checks the contract's bounds; device tensors skip the
    checks (no sync). Example (decode of N sequences, one token each)::

        y = short_conv_update(x, w, cache.conv[layer], slots, list(range(N + 1)))
    """
    check_device("short_conv_update", x, weight, conv_state)
    if x.ndim != 2 or weight.ndim != 2 or conv_state.ndim != 3:
        raise ValueError(f"x [T, C], weight [C, W], conv_state [slots, C, S]; got {x.shape}, {weight.shape}")
    t, c = x.shape
    kw = weight.shape[1]
    s = conv_state.shape[2]
    if weight.shape[0] != c or conv_state.shape[1] != c:
        raise ValueError(f"channels differ: x {c}, weight {weight.shape[0]}, conv_state {conv_state.shape[1]}")
    if kw < 2 or s < kw - 1:
        raise ValueError(f"need W >= 2 and a state width >= W-1, got W={kw}, S={s}")
    if conv_state.stride(2) != 1 or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x, weight and conv_state need a unit stride on their last axis")
    n = len(slots)
    device = x.device
    if not isinstance(query_start_loc, torch.Tensor):
        qsl = list(query_start_loc)
        if len(qsl) != n + 1 or qsl[0] != 0 or qsl[-1] != t:
            raise ValueError(f"query_start_loc must have N+1={n + 1} entries from 0 to T={t}, got {qsl}")
        max_len = max((qsl[i + 1] - qsl[i] for i in range(n)), default=0)
        if spec and max_len > s - (kw - 2):
            raise ValueError(f"a spec step of {max_len} tokens does not fit a state of width {s} (W={kw})")
    else:
        max_len = 16 if max_q_len is None else max_q_len
    if num_accepted is not None and not isinstance(num_accepted, torch.Tensor):
        bad = [a for a in num_accepted if not 1 <= a <= s - kw + 2]
        if bad:
            raise ValueError(f"num_accepted must be in [1, {s - kw + 2}] for state width {s}, got {bad}")
    slots_t = _as_int32(slots, n, device, "slots")
    if not isinstance(slots, torch.Tensor) and any(not -1 <= int(x_) < conv_state.shape[0] for x_ in slots):
        raise ValueError(f"slots must be in [-1, {conv_state.shape[0]}), got {list(slots)}")
    qsl_t = _as_int32(query_start_loc, n + 1, device, "query_start_loc")
    init = [True] * n if has_initial_state is None else has_initial_state
    init_t = _as_int32(init, n, device, "has_initial_state")
    acc_t = _as_int32(num_accepted, n, device, "num_accepted") if num_accepted is not None else slots_t
    if planes < 1 or c % planes:
        raise ValueError(f"planes must divide the {c} channels, got {planes}")
    shape = (t, c) if planes == 1 else (planes, t, c // planes)
    if out is None:
        out = x.new_empty(shape)
    elif out.shape != shape or out.stride(-1) != 1 or (planes > 1 and out.stride(1) != c // planes):
        raise ValueError(f"out must be {shape} with unit stride on its channels, got {tuple(out.shape)}")
    if n == 0:
        return out
    longest = max_len if not isinstance(query_start_loc, torch.Tensor) else (max_q_len or 0)
    launch = conv_launch(x, out, weight, conv_state, slots_t, qsl_t, acc_t, init_t, spec, num_accepted is not None,
                         tiles or default_tiles(max_len, c), longest, planes, low_rank)  # fmt: skip
    one = launch.n_chunks == 1
    _short_conv_kernel[launch.grid](
        *launch.args, launch.t_chunk, launch.n_chunks, *launch.lr_args, CONV=True, WRITE_STATE=one, **launch.meta,
        **launch.lr_meta, **pdl_kwargs(x, "conv.short_conv"),
    )  # fmt: skip
    if not one:  # every chunk has read the old window: now the states
        lr_args, lr_meta = low_rank_args(None, t, launch.c_blocks, x)
        _short_conv_kernel[(n, launch.c_blocks, 1)](
            *launch.args, launch.t_chunk, 1, *lr_args, CONV=False, WRITE_STATE=True, **launch.meta, **lr_meta,
            **pdl_kwargs(x, "conv.short_conv"),
        )  # fmt: skip
    return out


@dataclass(frozen=True)
class ConvLaunch:
    """A conv launch's arguments past the checks (``short_conv_update``; kernels/short_conv/in_proj_conv.py runs
    the same programs after a projection's in one launch): positional args up to stride_w_c, the chunking, the
    LR_* arguments, the constexprs, and the grid (sequences [+ the up-projections' row], channel blocks, chunks)."""

    args: tuple
    t_chunk: int
    n_chunks: int
    c_blocks: int
    lr_args: tuple
    meta: dict
    lr_meta: dict
    grid: tuple[int, int, int]


def conv_launch(
    x: torch.Tensor, out: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots_t: torch.Tensor,
    qsl_t: torch.Tensor, acc_t: torch.Tensor, init_t: torch.Tensor, spec: bool, has_acc: bool, tiles: ConvTiles,
    longest: int, planes: int, low_rank: LowRankUp | None,
) -> ConvLaunch:  # fmt: skip
    """The launch of checked inputs (x [T, C], out as ``short_conv_update`` shapes it, int32 device rows)."""
    (t, c), n, kw, s = x.shape, slots_t.shape[0], weight.shape[1], conv_state.shape[2]
    block_t, block_c, t_chunk = tiles.block_t, tiles.block_c, max(tiles.t_chunk, tiles.block_t)
    # the last chunk runs to its sequence's end, so a max_q_len hint that is too small costs speed, not tokens
    n_chunks = max(1, triton.cdiv(longest, t_chunk))
    args = (x, out, conv_state, weight, slots_t, qsl_t, acc_t, init_t, c, s)
    plane_stride, plane_c = (0, c) if planes == 1 else (out.stride(0), c // planes)
    args += (x.stride(0), out.stride(-2), plane_stride, plane_c)
    args += (conv_state.stride(0), conv_state.stride(1), weight.stride(0))
    meta = dict(KW=kw, SPEC=spec, HAS_ACC=has_acc, BLOCK_C=block_c, BLOCK_T=block_t)
    meta.update(BLOCK_S=next_pow2(max(s, kw - 1)), num_warps=tiles.num_warps)
    c_blocks = triton.cdiv(c, block_c)
    lr_args, lr_meta = low_rank_args(low_rank, t, c_blocks, x)
    lr_blocks = lr_args[6]  # LR_BLOCKS: the up-projections' programs, 0 without them
    grid = (n + (low_rank is not None), max(c_blocks, lr_blocks), n_chunks)
    return ConvLaunch(args, t_chunk, n_chunks, c_blocks, lr_args, meta, lr_meta, grid)


def write_windows(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> None:
    """Only the plain state write of ``short_conv_update`` (its second launch), for a conv computed elsewhere
    (kernels/short_conv/fla_adapter.py): each sequence's new window = the last W-1 columns of [old | x^T].
    Device int32 slots [N] (-1 skipped), query_start_loc [N+1], has_initial_state [N]; no host checks."""
    check_device("write_windows", x, weight, conv_state)
    n, (t, c), kw, s = slots.numel(), x.shape, weight.shape[1], conv_state.shape[2]
    if n == 0:
        return
    block_c = 256
    args = (x, x, conv_state, weight, slots, query_start_loc, slots, has_initial_state, c, s)
    args += (x.stride(0), x.stride(0), 0, c, conv_state.stride(0), conv_state.stride(1), weight.stride(0))
    meta = dict(KW=kw, SPEC=False, HAS_ACC=False, BLOCK_C=block_c, BLOCK_T=1, BLOCK_S=next_pow2(max(s, kw - 1)))
    lr_args, lr_meta = low_rank_args(None, t, 1, x)
    _short_conv_kernel[(n, triton.cdiv(c, block_c), 1)](
        *args, t, 1, *lr_args, CONV=False, WRITE_STATE=True, **meta, **lr_meta, num_warps=4,
        **pdl_kwargs(x, "conv.short_conv"),
    )  # fmt: skip


__all__ = [
    "ConvLaunch",
    "ConvTiles",
    "LowRankUp",
    "conv_launch",
    "default_tiles",
    "short_conv_program",
    "short_conv_update",
    "write_windows",
]
