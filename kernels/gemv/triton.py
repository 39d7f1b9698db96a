"""Skinny GEMM for decode-sized steps: y [M <= 16, N] = x [M, K] @ W [N, K]^T. Contract: kernels/gemv/naive.py.

At batch 1 a decode step's dense projections are GEMVs: each reads its whole weight (19-85 MB on the Kimi mid
shape) for a few KB of activations, so the time is the weight's bytes over the copy bandwidth. cuBLAS reached
~80 % of it on the 58 MB KDA input projection and ~47 % on the 19 MB output projections, which it splits over K
with a second reduce launch (9.3 us for 4.4 us of bytes). Here one launch streams the weight once: a program
owns ``block_n`` consecutive weight rows and walks K in ``block_k`` columns, unmasked where the shape allows, so
the loads are wide and pipelined. One row of x: fp32 products accumulated elementwise and reduced once at the
end (CUDA cores, no padding); 2-16 rows: ``tl.dot`` on a 16-row tile (tensor cores, fp32 accumulate). The sum
order is fixed by the tile, so the output is deterministic.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.gemv.norm_after import NormAfter, no_norm_after_args, norm_after_last_program, norm_after_outputs
from kernels.pdl import pdl_enter, pdl_kwargs, prefetch_budget_bytes
from kernels.prefetch.triton import prefetch_span_to_l2
from kernels.triton_utils import check_device, dot_config, mm, next_pow2

GEMV_MAX_ROWS = 16
"""The most rows of x a launch takes (one 16-row dot tile); longer steps are GEMMs: leave them to cuBLAS."""


@dataclass(frozen=True)
class GemvTile:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


ONE_ROW_TILES = {  # (N, K) -> the fastest tile of ``bench/gemv_sweep.py`` on the H200 (Kimi-Linear's real shapes)
    (12576, 2304): GemvTile(32, 256, 4, 3),  # KDA q|k|v|f_a|g_a|b: 16.1 us, cuBLAS 18.8
    (2304, 4096): GemvTile(8, 1024, 8, 3),  # o_proj (KDA, MLA): 7.3 us, cuBLAS 10.0 (split-K + reduce)
    (6720, 2304): GemvTile(8, 512, 4, 3),  # MLA q|kv_a: 10.4 us, cuBLAS 11.1
    (18432, 2304): GemvTile(8, 256, 4, 3),  # dense MLP gate|up: 22.4 us, cuBLAS 23.9
    (2304, 9216): GemvTile(8, 1024, 8, 3),  # dense MLP down: 12.6 us, cuBLAS 15.6
}


def gemv_tile(m: int, n: int, k: int) -> GemvTile:
    """The launch tile for [m, k] x [n, k]^T: one row by the sweep's table, else long rows of W (K >= 4096) in wide
    steps over few weight rows a program (more programs, each with more bytes in flight), short ones in 256-column
    steps (both within 2-5 % of the best tile at every swept shape); 2-16 rows: one 16-row dot tile. One row,
    ``TANDEM_GEMV_ONE_ROW_TILES`` first (``one_row_tile_overrides``)."""
    if m == 1:
        if (n, k) in (overrides := one_row_tile_overrides()):
            return overrides[(n, k)]
        if (n, k) in ONE_ROW_TILES:
            return ONE_ROW_TILES[(n, k)]
        return GemvTile(8, 1024, 8, 3) if k >= 4096 else GemvTile(16, 256, 4, 3)
    return GemvTile(block_n=32, block_k=128, num_warps=4, num_stages=4)


def parse_one_row_tiles(text: str) -> dict[tuple[int, int], GemvTile]:
    """``"NxK=BN/BK/W/S,..."``: the one-row tile (block_n / block_k / warps / stages) of each [N, K] weight named.
    Why: the sweep times a GEMV alone, but a launch with the norm after it (kernels/gemv/norm_after.py) takes a
    ticket in every program, which costs more the more waves of programs there are; A / B runs in the step
    choose between tiles the sweep found close (the MoE down launch's took half the programs: 39th session)."""
    tiles: dict[tuple[int, int], GemvTile] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            shape, tile = part.split("=")
            n, k = (int(v) for v in shape.lower().split("x"))
            bn, bk, warps, stages = (int(v) for v in tile.split("/"))
        except ValueError as err:
            raise ValueError(f"TANDEM_GEMV_ONE_ROW_TILES takes 'NxK=BN/BK/W/S,...', got {part!r}") from err
        if min(n, k, bn, bk, warps, stages) < 1 or any(v & (v - 1) for v in (bn, bk, warps)) or bk < 16:
            raise ValueError(f"TANDEM_GEMV_ONE_ROW_TILES: N, K, stages >= 1, BK >= 16, and BN, BK, W powers of "
                             f"two, got {part!r}")  # fmt: skip
        tiles[(n, k)] = GemvTile(bn, bk, warps, stages)
    return tiles


@functools.cache
def one_row_tile_overrides() -> dict[tuple[int, int], GemvTile]:
    """``TANDEM_GEMV_ONE_ROW_TILES`` parsed once (empty: the table's tiles)."""
    return parse_one_row_tiles(os.environ.get("TANDEM_GEMV_ONE_ROW_TILES", ""))


@triton.jit
def one_row_block(
    X, W, Y, i_n, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr
):  # fmt: skip
    """Weight rows [i_n * BLOCK_N, +BLOCK_N) of the one-row GEMV: fp32 products accumulated elementwise over K in
    BLOCK_K steps, reduced once, stored in Y's dtype (also the first part of kernels/short_conv/in_proj_conv.py)."""
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    # rows past N read row N - 1 (their results are not stored), so the weight loads need no row mask
    w_rows = W + tl.minimum(o_n, N - 1).to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(X + o_k)
            w = tl.load(w_rows + o_k[None, :])
        else:
            x = tl.load(X + o_k, mask=o_k < K, other=0.0)
            w = tl.load(w_rows + o_k[None, :], mask=o_k[None, :] < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(Y + o_n, y.to(Y.dtype.element_ty), mask=m_n)


@triton.jit
def _gemv_kernel(
    X,  # [M, K]
    W,  # [N, K]
    Y,  # [M, N]
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_y,
    RES,  # the norm after (NORM_AFTER, one row): kernels/gemv/norm_after.py
    NW,
    OUT,
    RES_OUT,
    TICKET,
    eps,
    PF_BYTES,  # PDL_PREFETCH: the most bytes of its weight slice a program asks into L2 before its wait
    ONE_ROW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    NORM_AFTER: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
    PDL_PREFETCH: tl.constexpr,  # only with USE_PDL and a contiguous, 16-byte-aligned W (kernels/pdl.py)
    PF_LANES: tl.constexpr,  # 32 x num_warps: one prefetch piece a thread
):
    if PDL_PREFETCH:  # launched early by PDL: W is read-only, so its bytes may move before the wait
        row0 = tl.program_id(0) * BLOCK_N
        row_bytes = stride_w.to(tl.int64) * W.dtype.element_ty.primitive_bitwidth // 8
        span = tl.minimum(N - row0, BLOCK_N).to(tl.int64) * row_bytes
        prefetch_span_to_l2(W.to(tl.pointer_type(tl.uint8)) + row0 * row_bytes, tl.minimum(span, PF_BYTES), PF_LANES)
    pdl_enter(USE_PDL)
    if ONE_ROW:
        one_row_block(X, W, Y, tl.program_id(0), N, K, stride_w, BLOCK_N, BLOCK_K, EVEN_K)
        if NORM_AFTER:
            norm_after_last_program(Y, RES, NW, OUT, RES_OUT, TICKET, N, eps, BLOCK_H)
    else:
        o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < N
        # rows past N read row N - 1 (their results are not stored), so the weight loads need no row mask
        w_rows = W + tl.minimum(o_n, N - 1).to(tl.int64)[:, None] * stride_w
        o_m = tl.arange(0, BLOCK_M)
        m_m = o_m < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                x = tl.load(X + o_m[:, None] * stride_x + o_k[None, :], mask=m_m[:, None], other=0.0)
                w = tl.load(w_rows + o_k[None, :])
            else:
                m_k = o_k < K
                x = tl.load(X + o_m[:, None] * stride_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
                w = tl.load(w_rows + o_k[None, :], mask=m_k[None, :], other=0.0)
            acc += mm(x, tl.trans(w), DOT_F32, PREC)
        y = Y + o_m[:, None] * stride_y + o_n[None, :]
        tl.store(y, acc.to(Y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def gemv(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, tile: GemvTile | None = None
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype (fp32 sums), 1 <= M <= ``GEMV_MAX_ROWS``. x may be a row-
    strided view; both need a unit stride on K. Written into ``out`` ([M, N], unit column stride) when given."""
    out = _checked_out("gemv", x, weight, out)
    m, k = x.shape
    if m == 0 or out.shape[1] == 0:
        return out
    if k == 0:
        return out.zero_()
    _launch(x, weight, out, tile, None)
    return out


def gemv_norm_after(
    x: torch.Tensor, weight: torch.Tensor, after: NormAfter, tile: GemvTile | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row: y = x [1, K] @ weight [N, K]^T, then ``(rms_norm(after.residual + y) * after.weight, after.residual
    + y)`` by the launch's last program (kernels/gemv/norm_after.py) -> (the norm's output [1, N] in x's dtype,
    the new residual [1, N] in the residual's dtype)."""
    y = _checked_out("gemv_norm_after", x, weight, None)
    if x.shape[0] != 1 or x.shape[1] == 0 or y.shape[1] == 0:
        raise ValueError(f"gemv_norm_after takes one row of K > 0 columns and N > 0 outputs, got x {tuple(x.shape)} "
                         f"and weight {tuple(weight.shape)}")  # fmt: skip
    out, res_out, args = norm_after_outputs(after, y, "gemv_norm_after")
    _launch(x, weight, y, tile, args)
    return out, res_out


def _checked_out(name: str, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    check_device(name, x, weight)
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] must share K, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a unit stride on K")
    m = x.shape[0]
    n = weight.shape[0]
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"gemv takes at most {GEMV_MAX_ROWS} rows of x (a decode-sized step), got {m}")
    if out is None:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    if out.shape != (m, n) or out.dtype != x.dtype or out.device != x.device or (m and out.stride(1) != 1):
        raise ValueError(f"out must be [{m}, {n}] {x.dtype} on {x.device} with a unit column stride")
    return out


def _launch(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, tile: GemvTile | None, after: dict[str, object] | None
) -> None:
    (m, k), n = x.shape, weight.shape[0]
    tile = tile or gemv_tile(m, n, k)
    if m > 1 and tile.block_n < 16:
        raise ValueError(f"rows > 1 run tl.dot: block_n must be >= 16, got {tile.block_n}")
    block_k = min(tile.block_k, max(16, next_pow2(k)))
    dot_f32, prec = dot_config(x.dtype)
    grid = triton.cdiv(n, tile.block_n)
    pdl = pdl_kwargs(x, "gemv.gemv")
    pf_bytes = _prefetch_bytes(weight, grid) if pdl["USE_PDL"] and m == 1 else 0
    _gemv_kernel[(grid,)](
        x,
        weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        **(after or no_norm_after_args(out)),
        PF_BYTES=pf_bytes,
        ONE_ROW=m == 1,
        BLOCK_M=16,
        BLOCK_N=tile.block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        DOT_F32=dot_f32,
        PREC=prec,
        NORM_AFTER=after is not None,
        PDL_PREFETCH=pf_bytes > 0,
        PF_LANES=32 * tile.num_warps,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **pdl,
    )


def _prefetch_bytes(weight: torch.Tensor, programs: int) -> int:
    """Bytes of its weight slice each program of a PDL launch asks into L2 before its wait: the launch's share of
    ``prefetch_budget_bytes`` (a multiple of 16), or 0 where the bulk prefetch cannot take the weight (not one
    contiguous, 16-byte-aligned range of 16-byte-multiple rows)."""
    row_bytes = weight.stride(0) * weight.element_size()
    if not weight.is_contiguous() or weight.data_ptr() % 16 or row_bytes % 16:
        return 0
    return prefetch_budget_bytes() // max(programs, 1) // 16 * 16


__all__ = ["GEMV_MAX_ROWS", "GemvTile", "gemv", "gemv_norm_after", "gemv_tile", "one_row_block", "parse_one_row_tiles"]
