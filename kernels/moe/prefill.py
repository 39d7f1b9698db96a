"""MoE experts at prefill sizes: tile-scheduled Triton grouped GEMMs with the gather and SwiGLU fused.
Contract: ``grouped.grouped_moe`` (its experts part); the decode-sized sibling is kernels/moe/decode.py.

At prefill a step routes tens of thousands of (token, expert) pairs, a few hundred rows per expert. The
grouped-GEMM path (``grouped.grouped_moe``) gathers x into expert order (a [T*k, H] copy), runs the gate-up
GEMM into a [T*k, 2I] buffer, SwiGLU over it into [T*k, I], then the down GEMM: three full passes over
activation-sized buffers besides the GEMMs (an 8k prefill of the mid shape, 7 MoE layers: gather 1.3 ms,
SwiGLU 1.2 ms). Here, on the expert-sorted layout (``MoEAlign``):

    tile map  one launch: each expert's rows cut into BLOCK_M-row tiles, tiles numbered in expert order
              -> (expert, first row) of every tile slot; slots past the last tile get expert -1
    gate-up   one program per (tile, BLOCK_N columns of I): loads its rows of x by token (the gather), the
              expert's gate and up columns, writes silu(gate) * up from the fp32 accumulators (the SwiGLU)
    down      one program per (tile, BLOCK_N columns of H): a @ w2[e]^T in sorted rows; by default only
              where torch's grouped_mm cannot run (fp32, older GPUs): on the H200 grouped_mm's down GEMM
              was faster than every tile swept (bench/moe_prefill_sweep.py)

Unlike the decode kernels (one program per expert, walking its rows), every program here has one row tile,
so long and short groups spread evenly over the SMs. The slot count is a host bound (``cdiv(N, BLOCK_M) +
E``), the map is built on the device: no host sync, CUDA-graph capturable. Programs of a tile run its column
blocks back to back (the tile's rows and the expert's weights stay in L2). Output rows are unweighted; the
combine (kernels/moe/combine.py) weights and sums each token's k rows in fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.moe.grouped import MoEAlign, grouped_gemm, grouped_mm_supported
from kernels.triton_utils import check_device, dot_config, mm, next_pow2


@dataclass(frozen=True)
class GemmTiles:
    """One grouped GEMM's launch: rows / columns / reduction per tile, warps, pipeline stages."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4


# bench/moe_prefill_sweep.py on the H200 (docs/PERFORMANCE.md): of 21 gate-up / 36 down tiles at 8k tokens,
# 128 x 128 (8 warps, 4 stages) gate-up 1.36 ms vs 1.52 for the gather + grouped_mm + SwiGLU it replaces;
# the best down tile (128 x 256) lost to torch's grouped_mm (0.71 vs 0.67 ms; 2.48 vs 2.01 at 32k).
GATE_UP_TILES = GemmTiles(128, 128, 64, num_warps=8, num_stages=4)
DOWN_TILES = GemmTiles(128, 256, 64, num_warps=8, num_stages=4)
FP32_TILES = GemmTiles(64, 64, 32, num_warps=4, num_stages=2)
"""fp32 operands take 4 bytes an element: the bf16 tiles' pipeline would not fit in shared memory."""


def default_tiles(dtype: torch.dtype) -> tuple[GemmTiles, GemmTiles]:
    """(gate-up, down) tiles for operands of ``dtype``."""
    return (FP32_TILES, FP32_TILES) if dtype == torch.float32 else (GATE_UP_TILES, DOWN_TILES)


SMEM_HEADROOM = 8 << 10
"""Shared memory left to the kernel besides its pipeline buffers (the epilogue's layout conversion)."""


def fit_stages(tiles: GemmTiles, weight_tiles: int, itemsize: int, smem_bytes: int) -> GemmTiles:
    """``tiles`` with fewer pipeline stages (at least 2) where ``smem_bytes`` of shared memory a block cannot
    hold ``tiles.num_stages`` stages of one activation tile and ``weight_tiles`` weight tiles: the H200's tiles
    (4 stages of 48 KB in the gate-up GEMM) need 3 stages on an A100 (164 KB) and 2 on 100 KB parts."""
    stage = (tiles.block_m * tiles.block_k + weight_tiles * tiles.block_n * tiles.block_k) * itemsize
    stages = max(2, min(tiles.num_stages, (smem_bytes - SMEM_HEADROOM) // stage))
    return tiles if stages == tiles.num_stages else replace(tiles, num_stages=stages)


@functools.cache
def _smem_per_block(device_index: int) -> int:
    return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])


def _fitted(tiles: GemmTiles, weight_tiles: int, x: torch.Tensor) -> GemmTiles:
    if not x.is_cuda:  # the interpreter has no shared memory to fit
        return tiles
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return fit_stages(tiles, weight_tiles, x.element_size(), _smem_per_block(index))


@triton.jit
def _tile_map_kernel(
    ENDS,  # [E] int32 end row of each expert's group
    TILE_E,  # [S] int32 out: expert of each tile slot, -1 past the last tile
    TILE_ROW,  # [S] int32 out: first row of each tile
    E,
    S,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # one program per BLOCK_S slots; each recomputes the experts' tile prefix sum (E values: cheaper than a
    # second launch) so the map is one short launch, not one program walking every slot (35 us at 8k tokens)
    o_e = tl.arange(0, BLOCK_E)
    m_e = o_e < E
    ends = tl.load(ENDS + o_e, mask=m_e, other=0)
    starts = tl.load(ENDS + o_e - 1, mask=m_e & (o_e > 0), other=0)
    tiles = tl.where(m_e, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    tile_end = tl.cumsum(tiles, 0)
    # first row of slot s of expert e: starts[e] + (s - tile_start[e]) * BLOCK_M
    base = starts - (tile_end - tiles) * BLOCK_M
    total = tl.sum(tiles, 0)
    o_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    e_of = tl.sum((tile_end[None, :] <= o_s[:, None]).to(tl.int32), 1)  # experts ending at or before s
    row = tl.sum(tl.where(o_e[None, :] == e_of[:, None], base[None, :], 0), 1) + o_s * BLOCK_M
    live = o_s < total
    tl.store(TILE_E + o_s, tl.where(live, e_of, -1), mask=o_s < S)
    tl.store(TILE_ROW + o_s, tl.where(live, row, 0), mask=o_s < S)


@triton.jit
def _gate_up_tiles_kernel(
    X,  # [T, H] activations
    TOKEN,  # [N] int64 token of each sorted row
    ENDS,  # [E] int32
    TILE_E,
    TILE_ROW,
    W13,  # [E, 2I, H] gate rows 0..I-1, up rows I..2I-1
    A,  # [N, I] out: silu(gate) * up, sorted rows
    H,
    INTER,
    up_offset,  # I * stride_wn
    num_n,  # column blocks of I
    stride_x,
    stride_we,
    stride_wn,
    stride_a,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    slot = pid // num_n
    e = tl.load(TILE_E + slot)
    if e < 0:
        return
    row0 = tl.load(TILE_ROW + slot)
    end = tl.load(ENDS + e)
    o_m = row0 + tl.arange(0, BLOCK_M)
    m_m = o_m < end
    tok = tl.load(TOKEN + o_m, mask=m_m, other=0)
    o_n = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < INTER
    o_k = tl.arange(0, BLOCK_K)
    p_x = X + tok[:, None] * stride_x + o_k[None, :]
    p_g = W13 + e.to(tl.int64) * stride_we + o_n[None, :].to(tl.int64) * stride_wn + o_k[:, None]  # [K, N]
    p_u = p_g + up_offset
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            x = tl.load(p_x, mask=m_m[:, None], other=0.0)
            g = tl.load(p_g, mask=m_n[None, :], other=0.0)
            u = tl.load(p_u, mask=m_n[None, :], other=0.0)
        else:
            m_k = (k0 + o_k) < H
            x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)
            g = tl.load(p_g, mask=m_k[:, None] & m_n[None, :], other=0.0)
            u = tl.load(p_u, mask=m_k[:, None] & m_n[None, :], other=0.0)
        acc_g += mm(x, g, DOT_F32, PREC)
        acc_u += mm(x, u, DOT_F32, PREC)
        p_x += BLOCK_K
        p_g += BLOCK_K
        p_u += BLOCK_K
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    p_a = A + o_m[:, None].to(tl.int64) * stride_a + o_n[None, :]
    tl.store(p_a, act.to(A.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _down_tiles_kernel(
    A,  # [N, I] sorted rows
    ENDS,  # [E] int32
    TILE_E,
    TILE_ROW,
    W2,  # [E, H, I]
    Y,  # [N, H] out, sorted rows
    H,
    INTER,
    num_n,  # column blocks of H
    stride_a,
    stride_we,
    stride_wn,
    stride_y,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    slot = pid // num_n
    e = tl.load(TILE_E + slot)
    if e < 0:
        return
    row0 = tl.load(TILE_ROW + slot)
    end = tl.load(ENDS + e)
    o_m = row0 + tl.arange(0, BLOCK_M)
    m_m = o_m < end
    o_n = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    o_k = tl.arange(0, BLOCK_K)
    p_a = A + o_m[:, None].to(tl.int64) * stride_a + o_k[None, :]
    p_w = W2 + e.to(tl.int64) * stride_we + o_n[None, :].to(tl.int64) * stride_wn + o_k[:, None]  # [K, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        if EVEN_K:
            a = tl.load(p_a, mask=m_m[:, None], other=0.0)
            w = tl.load(p_w, mask=m_n[None, :], other=0.0)
        else:
            m_k = (k0 + o_k) < INTER
            a = tl.load(p_a, mask=m_m[:, None] & m_k[None, :], other=0.0)
            w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0)
        acc += mm(a, w, DOT_F32, PREC)
        p_a += BLOCK_K
        p_w += BLOCK_K
    p_y = Y + o_m[:, None].to(tl.int64) * stride_y + o_n[None, :]
    tl.store(p_y, acc.to(Y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def tile_map(ends: torch.Tensor, num_rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, first row) of each BLOCK_M-row tile of the groups ending at ``ends`` [E] int32, over
    ``cdiv(num_rows, block_m) + E`` slots (a bound on the tile count; unused slots get expert -1)."""
    e = ends.shape[0]
    slots = triton.cdiv(num_rows, block_m) + e
    tile_e = torch.empty(slots, dtype=torch.int32, device=ends.device)
    tile_row = torch.empty(slots, dtype=torch.int32, device=ends.device)
    block_s = 32
    _tile_map_kernel[(triton.cdiv(slots, block_s),)](
        ends, tile_e, tile_row, e, slots, BLOCK_M=block_m, BLOCK_E=next_pow2(e), BLOCK_S=block_s, num_warps=4
    )
    return tile_e, tile_row


@dataclass(frozen=True)
class TileMap:
    """A step's row tiles for one BLOCK_M: group ends [E] int32 and ``tile_map``'s (expert, first row) per slot."""

    block_m: int
    ends: torch.Tensor
    tile_e: torch.Tensor
    tile_row: torch.Tensor


def _tiles_of(al: MoEAlign, n: int, block_m: int, given: TileMap | None) -> TileMap:
    if given is not None and given.block_m == block_m:
        return given  # the gate-up GEMM's map, reused by the down GEMM
    ends = al.offsets.to(torch.int32)
    return TileMap(block_m, ends, *tile_map(ends, n, block_m))


def _check(x: torch.Tensor, al: MoEAlign, w13: torch.Tensor, w2: torch.Tensor) -> None:
    check_device("moe_experts_prefill", x, al.token, al.offsets, w13, w2)
    e, i2, h = w13.shape
    i = i2 // 2
    if x.ndim != 2 or x.shape[1] != h or w2.shape != (e, h, i) or al.offsets.shape != (e,) or i2 != 2 * i:
        raise ValueError(
            f"x [T, H], w13 [E, 2I, H], w2 [E, H, I], offsets [E]; got {tuple(x.shape)}, {tuple(w13.shape)}, "
            f"{tuple(w2.shape)}, {tuple(al.offsets.shape)}"
        )
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("x, w13 and w2 must be contiguous along their last dimension")


def gate_up_fused(
    x: torch.Tensor, al: MoEAlign, w13: torch.Tensor, tiles: GemmTiles, tmap: TileMap | None = None
) -> torch.Tensor:
    """silu(x[token] @ w1[e]^T) * (x[token] @ w3[e]^T) per sorted row: [N, I] in x's dtype (one launch, and the
    tile map unless ``tmap`` is the step's for these tiles). No shape checks: ``moe_experts_prefill`` makes them."""
    _, i2, h = w13.shape
    i = i2 // 2
    n = al.token.numel()
    a = torch.empty(n, i, dtype=x.dtype, device=x.device)
    if n == 0:
        return a
    dot_f32, prec = dot_config(x.dtype)
    tiles = _fitted(tiles, 2, x)
    tm = _tiles_of(al, n, tiles.block_m, tmap)
    num_n = triton.cdiv(i, tiles.block_n)
    _gate_up_tiles_kernel[(tm.tile_e.numel() * num_n,)](
        x, al.token, tm.ends, tm.tile_e, tm.tile_row, w13, a, h, i, i * w13.stride(1), num_n, x.stride(0),
        w13.stride(0), w13.stride(1), a.stride(0), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        EVEN_K=h % tiles.block_k == 0, DOT_F32=dot_f32, PREC=prec, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )  # fmt: skip
    return a


def down_grouped(
    a: torch.Tensor, al: MoEAlign, w2: torch.Tensor, tiles: GemmTiles, tmap: TileMap | None = None
) -> torch.Tensor:
    """a[row] @ w2[e]^T per sorted row: [N, H] in a's dtype (one launch, and the tile map unless ``tmap`` is the
    step's for these tiles)."""
    _, h, i = w2.shape
    n = a.shape[0]
    y = torch.empty(n, h, dtype=a.dtype, device=a.device)
    if n == 0:
        return y
    dot_f32, prec = dot_config(a.dtype)
    tiles = _fitted(tiles, 1, a)
    tm = _tiles_of(al, n, tiles.block_m, tmap)
    num_n = triton.cdiv(h, tiles.block_n)
    _down_tiles_kernel[(tm.tile_e.numel() * num_n,)](
        a, tm.ends, tm.tile_e, tm.tile_row, w2, y, h, i, num_n, a.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, EVEN_K=i % tiles.block_k == 0,
        DOT_F32=dot_f32, PREC=prec, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return y


def moe_experts_prefill(
    x: torch.Tensor,
    al: MoEAlign,
    w13: torch.Tensor,
    w2: torch.Tensor,
    gate_up: GemmTiles | None = None,
    down: GemmTiles | None = None,
    down_impl: str = "auto",
) -> torch.Tensor:
    """x [T, H]; al: the sorted layout of the step's T*k pairs; w13 [E, 2I, H] (gate | up); w2 [E, H, I]
    -> the expert outputs [T*k, H] in sorted rows (unweighted; ``moe_combine`` weights and sums them).
    gate_up / down: the two GEMMs' tiles (None: ``default_tiles``). down_impl: "triton" (``down_grouped``),
    "grouped_mm" (torch's, faster on the H200; bf16 CUDA only) or "auto" (grouped_mm where supported)."""
    _check(x, al, w13, w2)
    if down_impl not in ("auto", "triton", "grouped_mm"):
        raise ValueError(f"down_impl must be auto, triton or grouped_mm, got {down_impl!r}")
    gu, dn = (gate_up or default_tiles(x.dtype)[0]), (down or default_tiles(x.dtype)[1])
    n = al.token.numel()
    tmap = _tiles_of(al, n, gu.block_m, None) if n else None  # one map for both GEMMs where their rows agree
    a = gate_up_fused(x, al, w13, gu, tmap)
    if down_impl == "auto":
        down_impl = "grouped_mm" if grouped_mm_supported(a) else "triton"
    if down_impl == "grouped_mm":
        return grouped_gemm(a, w2, al.offsets)
    return down_grouped(a, al, w2, dn, tmap)


__all__ = [
    "DOWN_TILES",
    "FP32_TILES",
    "GATE_UP_TILES",
    "GemmTiles",
    "TileMap",
    "default_tiles",
    "down_grouped",
    "fit_stages",
    "gate_up_fused",
    "moe_experts_prefill",
    "tile_map",
]
