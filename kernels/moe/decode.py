"""MoE experts at decode sizes in two Triton launches. Contract: ``grouped.grouped_moe`` (its experts part).

At decode a step routes a few hundred (token, expert) pairs over up to all 256 experts, a handful of rows
each: the work is reading every hit expert's weights once. The grouped-GEMM path spends ~8 kernels a layer
(gather of x, two grouped GEMMs with their setup kernels, SiLU, multiply) and tiles built for long groups.
Here, on the expert-sorted layout of kernels/moe/align.py:

    gate-up   one program per (expert, BLOCK_N columns of I): gathers its rows of x by token, streams the
              expert's gate and up rows for those columns over H, writes silu(gate) * up (sorted rows)
    down      one program per (expert, BLOCK_N columns of H): streams the expert's down rows over I

Programs of experts with no rows return at once. The combine (kernels/moe/combine.py) then sums each
token's k rows in fp32. Graph-safe: group bounds are read on the device.

One token (a batch-1 decode step) needs no sorted layout: its k experts are distinct, so pair s is row s and
expert ``ids[s]`` (``pair_rows``): the align launch leaves each MoE layer of the step, and the combine reads the
rows in pair order. Above one token pairs may share an expert, which the sorted layout reads once.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.moe.grouped import MoEAlign
from kernels.moe.tiles import GemmTiles
from kernels.pdl import pdl_enter, pdl_kwargs
from kernels.triton_utils import check_device, dot_config, mm

MAX_PAIRS = 4096
"""Decode sizes: above this many pairs, groups are long and the grouped GEMMs' tiles win (to be measured)."""


@triton.jit
def _expert_of_program(ENDS, IDS, POS, COMPACT: tl.constexpr, PAIR_ROWS: tl.constexpr):
    """(expert, its first sorted row, its end row) of this program's axis-0 index; start -1: nothing to do.

    Not compact: one program per expert, most of them empty at decode sizes (8 of 256 experts at batch 1, yet
    256 x columns programs launched). Compact: one program per (token, slot) pair, which takes its pair's expert
    only when it is that expert's first pair in sorted order, so every expert with rows is taken once and the
    grid is min(T*k, E) wide. Pair rows: one program per pair, row = pair, no sorted layout (one token)."""
    # one return: Triton's code generator also types the statements after a return inside a constexpr branch, so
    # an early return there must agree with them (pair rows pass int64 ids as ENDS, which is not read)
    slot = tl.program_id(0)
    if PAIR_ROWS:
        e = tl.load(IDS + slot).to(tl.int32)
        start = slot
        end = slot + 1
    else:
        if COMPACT:
            e = tl.load(IDS + slot).to(tl.int32)
        else:
            e = slot
        start = tl.load(ENDS + e - 1, mask=e > 0, other=0).to(tl.int32)
        end = tl.load(ENDS + e).to(tl.int32)
        if COMPACT:
            start = tl.where(tl.load(POS + slot) == start, start, -1)
    return e, start, end


@triton.jit
def _gate_up_kernel(
    X,  # [T, H] activations
    TOKEN,  # [N] int64 token of each sorted row (not read with PAIR_ROWS: one token)
    ENDS,  # [E] int32 end row of each expert's group
    IDS,  # [N] int64 expert of each pair (COMPACT, PAIR_ROWS)
    POS,  # [N] int64 sorted row of each pair (COMPACT)
    W13,  # [E, 2I, H] gate rows 0..I-1, up rows I..2I-1 (I = INTER)
    A,  # [N, I] out: silu(gate) * up, sorted rows
    H,
    INTER,
    up_offset,  # I * stride_wn: the up rows' offset from the gate rows
    stride_x,
    stride_we,
    stride_wn,
    stride_a,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    COMPACT: tl.constexpr,
    PAIR_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    e, start, end = _expert_of_program(ENDS, IDS, POS, COMPACT, PAIR_ROWS)
    if start >= 0:
        gate_up_rows(
            X, TOKEN, W13, A, e, start, end, tl.program_id(1), H, INTER, up_offset, stride_x, stride_we, stride_wn,
            stride_a, BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PREC, PAIR_ROWS,
        )  # fmt: skip


@triton.jit
def gate_up_rows(
    X, TOKEN, W13, A, e, start, end, i_n, H, INTER, up_offset, stride_x, stride_we, stride_wn, stride_a,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
    PAIR_ROWS: tl.constexpr,
):  # fmt: skip
    """Expert e's sorted rows [start, end), columns block ``i_n`` of I: silu(gate) * up into A."""
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < INTER
    w_gate = W13 + e.to(tl.int64) * stride_we + o_n[:, None].to(tl.int64) * stride_wn
    w_up = w_gate + up_offset
    for m0 in range(start, end, BLOCK_M):
        o_m = m0 + tl.arange(0, BLOCK_M)
        m_m = o_m < end
        if PAIR_ROWS:
            tok = o_m * 0
        else:
            tok = tl.load(TOKEN + o_m, mask=m_m, other=0)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < H
            x = tl.load(X + tok[:, None] * stride_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
            m_w = m_n[:, None] & m_k[None, :]
            g = tl.load(w_gate + o_k[None, :], mask=m_w, other=0.0)
            u = tl.load(w_up + o_k[None, :], mask=m_w, other=0.0)
            acc_g += mm(x, tl.trans(g), DOT_F32, PREC)
            acc_u += mm(x, tl.trans(u), DOT_F32, PREC)
        act = acc_g * tl.sigmoid(acc_g) * acc_u
        p_a = A + o_m[:, None].to(tl.int64) * stride_a + o_n[None, :]
        tl.store(p_a, act.to(A.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def down_program(
    A, ENDS, IDS, POS, W2, Y, H, INTER, stride_a, stride_we, stride_wn, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
    COMPACT: tl.constexpr, PAIR_ROWS: tl.constexpr,
):  # fmt: skip
    """This program's (expert, BLOCK_N columns of H) of the down GEMM: streams the expert's down rows over I."""
    e, start, end = _expert_of_program(ENDS, IDS, POS, COMPACT, PAIR_ROWS)
    if start >= 0:
        down_rows(
            A, W2, Y, e, start, end, tl.program_id(1), H, INTER, stride_a, stride_we, stride_wn, stride_y,
            BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PREC, "",
        )  # fmt: skip


@triton.jit
def down_rows(
    A, W2, Y, e, start, end, i_n, H, INTER, stride_a, stride_we, stride_wn, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
    A_CACHE: tl.constexpr,
):  # fmt: skip
    """Expert e's rows [start, end) of A, columns block ``i_n`` of H, into Y. A_CACHE: A's load cache modifier
    (".cg" where other programs of the same launch wrote A: kernels/moe/route_gate_up.py's down programs)."""
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    w = W2 + e.to(tl.int64) * stride_we + o_n[:, None].to(tl.int64) * stride_wn
    for m0 in range(start, end, BLOCK_M):
        o_m = m0 + tl.arange(0, BLOCK_M)
        m_m = o_m < end
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < INTER
            a = tl.load(
                A + o_m[:, None].to(tl.int64) * stride_a + o_k[None, :],
                mask=m_m[:, None] & m_k[None, :],
                other=0.0,
                cache_modifier=A_CACHE,
            )
            b = tl.load(w + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
            acc += mm(a, tl.trans(b), DOT_F32, PREC)
        p_y = Y + o_m[:, None].to(tl.int64) * stride_y + o_n[None, :]
        tl.store(p_y, acc.to(Y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _down_kernel(
    A,  # [N, I] sorted rows
    ENDS,  # [E] int32
    IDS,  # [N] int64 (COMPACT, PAIR_ROWS)
    POS,  # [N] int64 (COMPACT)
    W2,  # [E, H, I]
    Y,  # [N, H] out, sorted rows
    H,
    INTER,
    stride_a,
    stride_we,
    stride_wn,
    stride_y,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    COMPACT: tl.constexpr,
    PAIR_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    down_program(
        A, ENDS, IDS, POS, W2, Y, H, INTER, stride_a, stride_we, stride_wn, stride_y,
        BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PREC, COMPACT, PAIR_ROWS,
    )  # fmt: skip


def decode_gemm_tiles(block_m: int, block_n: int, block_k: int = 128, num_warps: int = 4) -> GemmTiles:
    """A decode expert kernel's tiles; 3 stages, Triton's default, as the launches had before they took tiles."""
    return GemmTiles(block_m, block_n, block_k, num_warps=num_warps, num_stages=3)


def decode_tiles(tokens: int) -> tuple[GemmTiles, GemmTiles]:
    """The gate-up and down kernels' tiles of a T-token step. Up to 16 tokens an expert has at most 16 rows:
    one row block, 32 columns (229 us at T=1 against 249 us with 64 columns on the H200, fewer idle programs
    for 8 experts). Above, routing is skewed (the mid model's b64 steps put up to ~40 rows on an expert) and a
    16-row block walks the expert's weights once per block: 32 x 64 tiles ran 350 us against 373 us with a
    shared per-expert logit bias, 720 vs 716 us under uniform routing (``python -m bench.moe_decode_sweep``).

    One token: ``TANDEM_MOE_ONE_ROW_TILES`` (``bench.moe_decode_sweep --pair-rows`` prints it) overrides both
    tiles for A / B runs; the down launch with the combine + norm in it has its own default
    (``down_norm_tiles``)."""
    if tokens == 1 and (override := one_row_tiles_override()) is not None:
        return override
    tiles = _UP_TO_16_TOKENS if tokens <= 16 else _ABOVE_16_TOKENS
    return tiles, tiles


def down_norm_tiles() -> GemmTiles:
    """The tile of one token's down launch that runs the combine + norm (kernels/moe/down_norm.py): 64 columns.
    Every program of it takes a ticket (a barrier and a GPU-scope acq_rel atomic) for the combine + norm its last
    program runs, and with half the programs (324, ~1.2 waves of two a SM) the launch took 16.3 against 17.3 us in
    the b1 step on the H200, same bits (thirty-ninth session). The plain down kernel keeps ``decode_tiles``'."""
    override = one_row_tiles_override()
    return override[1] if override is not None else _DOWN_NORM


_UP_TO_16_TOKENS, _ABOVE_16_TOKENS = decode_gemm_tiles(16, 32), decode_gemm_tiles(32, 64)  # built once: per-launch path
_DOWN_NORM = decode_gemm_tiles(16, 64)


def parse_one_row_tiles(text: str) -> tuple[GemmTiles, GemmTiles]:
    """``"N/K/W,N/K/W"``: BLOCK_N / BLOCK_K / warps of the gate-up kernel, then of the down kernel."""
    try:
        fields = [[int(v) for v in part.split("/")] for part in text.split(",")]
        if len(fields) != 2 or any(len(f) != 3 for f in fields):
            raise ValueError("two kernels of three numbers each")
        gate_up, down = (decode_gemm_tiles(16, *f) for f in fields)
    except ValueError as err:
        raise ValueError(f"TANDEM_MOE_ONE_ROW_TILES must be 'N/K/W,N/K/W' (gate-up, down), got {text!r}") from err
    for t in (gate_up, down):
        if min(t.block_n, t.block_k) < 16 or any(v & (v - 1) for v in (t.block_n, t.block_k, t.num_warps)):
            raise ValueError(f"TANDEM_MOE_ONE_ROW_TILES: blocks >= 16 and powers of two, got {text!r}")
    return gate_up, down


@functools.cache
def one_row_tiles_override() -> tuple[GemmTiles, GemmTiles] | None:
    text = os.environ.get("TANDEM_MOE_ONE_ROW_TILES", "").strip()
    return parse_one_row_tiles(text) if text else None


def moe_experts_decode(
    x: torch.Tensor,
    al: MoEAlign | None,
    w13: torch.Tensor,
    w2: torch.Tensor,
    gate_up: GemmTiles | None = None,
    down: GemmTiles | None = None,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H]; al: the sorted layout of the step's T*k pairs; w13 [E, 2I, H] (gate | up); w2 [E, H, I]
    -> the expert outputs [T*k, H] in sorted rows (unweighted; ``moe_combine`` weights and sums them).
    gate_up / down: the two kernels' tiles (None: ``decode_tiles`` of T; ``num_stages`` as the launch's).
    ids: the pairs' experts [T*k] (flat, pair order): with fewer pairs than experts the grid runs over pairs,
    not experts (``_expert_of_program``), so no program is launched for an expert without rows.
    al None (pair rows): one token, whose k experts must be distinct (a top-k); the rows come out in pair order,
    so the combine takes ``rows=None``."""
    check_device("moe_experts_decode", x, w13, w2, *(() if al is None else (al.token, al.offsets)))
    e, i2, h = w13.shape
    i = i2 // 2
    if x.ndim != 2 or x.shape[1] != h or w2.shape != (e, h, i) or (al is not None and al.offsets.shape != (e,)):
        raise ValueError(
            f"x [T, H], w13 [E, 2I, H], w2 [E, H, I], offsets [E]; got {tuple(x.shape)}, {tuple(w13.shape)}, "
            f"{tuple(w2.shape)}, {None if al is None else tuple(al.offsets.shape)}"
        )
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("x, w13 and w2 must be contiguous along their last dimension")
    if al is None and (x.shape[0] != 1 or ids is None or ids.ndim != 1):
        raise ValueError(
            "pair rows (al=None) take one token and its experts as ids [k]; "
            f"got x {tuple(x.shape)}, ids {None if ids is None else tuple(ids.shape)}"
        )
    default_gu, default_dn = decode_tiles(x.shape[0])
    gu, dn = gate_up or default_gu, down or default_dn
    n = ids.numel() if al is None else al.token.numel()
    a = torch.empty(n, i, dtype=x.dtype, device=x.device)
    y = torch.empty(n, h, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    dot_f32, prec = dot_config(x.dtype)
    blocks = dict(DOT_F32=dot_f32, PREC=prec)
    if al is None:
        token, ends, pairs, pos, grid0, compact = ids, ids, ids, ids, n, False  # only IDS is read
    else:
        token, ends = al.token, al.offsets.to(torch.int32)
        compact = ids is not None and n < e
        if compact:
            if ids.shape != (n,):
                raise ValueError(f"ids must be the [{n}] experts of the pairs, got {tuple(ids.shape)}")
            pairs, pos, grid0 = ids, al.rows_of_pairs(), n
        else:
            pairs, pos, grid0 = ends, ends, e  # unused pointers
    blocks.update(COMPACT=compact, PAIR_ROWS=al is None)
    launch_gate_up(x, token, ends, pairs, pos, w13, a, grid0, gu, blocks)
    _down_kernel[(grid0, triton.cdiv(h, dn.block_n))](
        a, ends, pairs, pos, w2, y, h, i, a.stride(0), w2.stride(0), w2.stride(1), y.stride(0), **blocks,
        BLOCK_M=dn.block_m, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, num_warps=dn.num_warps, num_stages=dn.num_stages,
        **pdl_kwargs(x, "moe.down"),
    )  # fmt: skip
    return y


def launch_gate_up(
    x: torch.Tensor,
    token: torch.Tensor,
    ends: torch.Tensor,
    pairs: torch.Tensor,
    pos: torch.Tensor,
    w13: torch.Tensor,
    a: torch.Tensor,
    grid0: int,
    gu: GemmTiles,
    blocks: dict[str, object],
) -> None:
    """The gate-up launch into a [N, I] (checked arguments: ``moe_experts_decode``, kernels/moe/down_norm.py)."""
    h, i = x.shape[1], a.shape[1]
    _gate_up_kernel[(grid0, triton.cdiv(i, gu.block_n))](
        x, token, ends, pairs, pos, w13, a, h, i, i * w13.stride(1), x.stride(0), w13.stride(0), w13.stride(1),
        a.stride(0), **blocks, BLOCK_M=gu.block_m, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k,
        num_warps=gu.num_warps, num_stages=gu.num_stages, **pdl_kwargs(x, "moe.gate_up"),
    )  # fmt: skip


__all__ = [
    "MAX_PAIRS",
    "decode_gemm_tiles",
    "decode_tiles",
    "down_program",
    "gate_up_rows",
    "launch_gate_up",
    "moe_experts_decode",
    "parse_one_row_tiles",
]
