"""Row tiles of the MoE prefill GEMMs: tile shapes, their fit in shared memory, and the tile map (which
expert and first row each BLOCK_M-row tile of the expert-sorted layout covers), built on the device in one
launch. Shared by the pointer kernels (kernels/moe/prefill.py) and the TMA gate-up (kernels/moe/prefill_tma.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.moe.grouped import MoEAlign
from kernels.triton_utils import next_pow2


@dataclass(frozen=True)
class GemmTiles:
    """One grouped GEMM's launch: rows / columns / reduction per tile, warps, pipeline stages."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4


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
def smem_per_block(device_index: int) -> int:
    return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])


def fitted(tiles: GemmTiles, weight_tiles: int, x: torch.Tensor) -> GemmTiles:
    if not x.is_cuda:  # the interpreter has no shared memory to fit
        return tiles
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return fit_stages(tiles, weight_tiles, x.element_size(), smem_per_block(index))


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
def tile_slot(TILE_E, TILE_ROW, ENDS, num_n, BLOCK_N: tl.constexpr):
    """The GEMM program's tile of a ``tile_map``, programs numbered (slot, column block) with ``num_n`` column
    blocks a slot: (expert, -1 for an unused slot; its first row; the expert's end row; its first column).
    The caller returns at once on expert -1."""
    pid = tl.program_id(0)
    slot = pid // num_n
    e = tl.load(TILE_E + slot)
    row0 = tl.load(TILE_ROW + slot)
    end = tl.load(ENDS + tl.maximum(e, 0))
    return e, row0, end, (pid % num_n) * BLOCK_N


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


def tiles_of(al: MoEAlign, n: int, block_m: int, given: TileMap | None) -> TileMap:
    if given is not None and given.block_m == block_m:
        return given  # the gate-up GEMM's map, reused by the down GEMM
    ends = al.offsets.to(torch.int32)
    return TileMap(block_m, ends, *tile_map(ends, n, block_m))


__all__ = [
    "SMEM_HEADROOM",
    "GemmTiles",
    "TileMap",
    "fit_stages",
    "fitted",
    "smem_per_block",
    "tile_map",
    "tile_slot",
    "tiles_of",
]
