"""MoE experts at prefill sizes: tile-scheduled Triton grouped GEMMs with the gather and SwiGLU fused.
Contract: ``grouped.grouped_moe`` (its experts part); the decode-sized sibling is kernels/moe/decode.py.

At prefill a step routes tens of thousands of (token, expert) pairs, a few hundred rows per expert. The
grouped-GEMM path (``grouped.grouped_moe``) gathers x into expert order (a [T*k, H] copy), runs the gate-up
GEMM into a [T*k, 2I] buffer, SwiGLU over it into [T*k, I], then the down GEMM: three full passes over
activation-sized buffers besides the GEMMs (an 8k prefill of the mid shape, 7 MoE layers: gather 1.3 ms,
SwiGLU 1.2 ms). Here, on the expert-sorted layout (``MoEAlign``):

    tile map  one launch (kernels/moe/tiles.py): each expert's rows cut into BLOCK_M-row tiles, numbered in
              expert order -> (expert, first row) of every tile slot; slots past the last tile get expert -1
    gate-up   one program per (tile, BLOCK_N columns of I): loads its rows of x by token (the gather), the
              expert's gate and up columns, writes silu(gate) * up from the fp32 accumulators (the SwiGLU)
              (on Hopper the same kernel with the weight tiles through TMA: kernels/moe/prefill_tma.py)
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

from dataclasses import replace

import torch
import triton
import triton.language as tl

from kernels.moe.grouped import MoEAlign, grouped_gemm, grouped_mm_supported
from kernels.moe.prefill_tma import down_tma, gate_up_tma, tma_usable
from kernels.moe.tiles import GemmTiles, TileMap, fit_stages, fitted, tile_map, tile_slot, tiles_of
from kernels.triton_utils import check_device, dot_config, mm

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
    e, row0, end, n0 = tile_slot(TILE_E, TILE_ROW, ENDS, num_n, BLOCK_N)
    if e < 0:
        return
    o_m = row0 + tl.arange(0, BLOCK_M)
    m_m = o_m < end
    tok = tl.load(TOKEN + o_m, mask=m_m, other=0)
    o_n = n0 + tl.arange(0, BLOCK_N)
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
    e, row0, end, n0 = tile_slot(TILE_E, TILE_ROW, ENDS, num_n, BLOCK_N)
    if e < 0:
        return
    o_m = row0 + tl.arange(0, BLOCK_M)
    m_m = o_m < end
    o_n = n0 + tl.arange(0, BLOCK_N)
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
    tiles = fitted(tiles, 2, x)
    tm = tiles_of(al, n, tiles.block_m, tmap)
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
    tiles = fitted(tiles, 1, a)
    tm = tiles_of(al, n, tiles.block_m, tmap)
    num_n = triton.cdiv(h, tiles.block_n)
    _down_tiles_kernel[(tm.tile_e.numel() * num_n,)](
        a, tm.ends, tm.tile_e, tm.tile_row, w2, y, h, i, num_n, a.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, EVEN_K=i % tiles.block_k == 0,
        DOT_F32=dot_f32, PREC=prec, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return y


TMA_LONG_PAIRS = 128 << 10
"""From this many (token, expert) pairs the TMA gate-up runs 3 pipeline stages, below it 4, and the down GEMM
leaves TMA for torch's grouped_mm. On the H200: gate-up (``python -m bench.moe_gate_up_tma``) 4 stages won at
8k tokens (1.18 vs 1.27 ms), 3 at 32k (4.06 vs 4.33); down (``python -m bench.moe_down_tma``, two runs) TMA
0.622 vs grouped_mm 0.652 ms at 8k, 1.097 vs 1.118 at 16k, 2.02-2.05 vs 2.00 at 32k (outputs identical)."""


def moe_experts_prefill(
    x: torch.Tensor,
    al: MoEAlign,
    w13: torch.Tensor,
    w2: torch.Tensor,
    gate_up: GemmTiles | None = None,
    down: GemmTiles | None = None,
    down_impl: str = "auto",
    gate_up_impl: str = "auto",
) -> torch.Tensor:
    """x [T, H]; al: the sorted layout of the step's T*k pairs; w13 [E, 2I, H] (gate | up); w2 [E, H, I]
    -> the expert outputs [T*k, H] in sorted rows (unweighted; ``moe_combine`` weights and sums them).
    gate_up / down: the two GEMMs' tiles (None: ``default_tiles``). down_impl: "triton" (``down_grouped``),
    "grouped_mm" (torch's; bf16 CUDA only), "tma" (``prefill_tma.down_tma``, both operands through TMA) or
    "auto" (tma where ``tma_usable`` below ``TMA_LONG_PAIRS`` pairs, else grouped_mm where supported).
    gate_up_impl: "pointer" (``gate_up_fused``), "tma" (``prefill_tma.gate_up_tma``, the weights through
    tensor descriptors: 8-11 % faster on the H200, same outputs) or "auto" (tma where ``tma_usable``)."""
    _check(x, al, w13, w2)
    if down_impl not in ("auto", "triton", "grouped_mm", "tma"):
        raise ValueError(f"down_impl must be auto, triton, grouped_mm or tma, got {down_impl!r}")
    if gate_up_impl not in ("auto", "pointer", "tma"):
        raise ValueError(f"gate_up_impl must be auto, pointer or tma, got {gate_up_impl!r}")
    gu, dn = (gate_up or default_tiles(x.dtype)[0]), (down or default_tiles(x.dtype)[1])
    n = al.token.numel()
    tmap = tiles_of(al, n, gu.block_m, None) if n else None  # one map for both GEMMs where their rows agree
    if gate_up_impl == "auto":
        gate_up_impl = "tma" if tma_usable(x, w13) else "pointer"
    if gate_up_impl == "tma":
        if gate_up is None and n >= TMA_LONG_PAIRS:
            gu = replace(gu, num_stages=min(gu.num_stages, 3))
        a = gate_up_tma(x, al, w13, gu, tmap)
    else:
        a = gate_up_fused(x, al, w13, gu, tmap)
    if down_impl == "auto":
        if n < TMA_LONG_PAIRS and tma_usable(a, w2):
            down_impl = "tma"
        else:
            down_impl = "grouped_mm" if grouped_mm_supported(a) else "triton"
    if down_impl == "grouped_mm":
        return grouped_gemm(a, w2, al.offsets)
    if down_impl == "tma":
        return down_tma(a, al, w2, dn, tmap)
    return down_grouped(a, al, w2, dn, tmap)


__all__ = [
    "DOWN_TILES",
    "FP32_TILES",
    "GATE_UP_TILES",
    "TMA_LONG_PAIRS",
    "GemmTiles",
    "TileMap",
    "default_tiles",
    "down_grouped",
    "fit_stages",
    "gate_up_fused",
    "moe_experts_prefill",
    "tile_map",
]
