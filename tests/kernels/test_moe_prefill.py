"""kernels/moe/prefill.py: the tile map and the tile-scheduled expert GEMMs vs kernels/moe/naive.py."""

from __future__ import annotations

import pytest
import torch

from kernels.moe.combine import moe_combine_triton
from kernels.moe.grouped import moe_align
from kernels.moe.naive import naive_moe, sigmoid_topk_route
from kernels.moe.prefill import (
    DOWN_TILES,
    FP32_TILES,
    GATE_UP_TILES,
    GemmTiles,
    default_tiles,
    fit_stages,
    moe_experts_prefill,
    tile_map,
)
from tests.kernels.helpers import DEVICE, assert_close, tol


def _problem(t: int, e: int, k: int, h: int, i: int, seed: int, dtype: torch.dtype = torch.float32):
    """x [t, h], w13 [e, 2i, h], w2 [e, h, i] in ``dtype`` on the device, and a sigmoid top-k routing."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(DEVICE, dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(DEVICE, dtype)
    w2 = (torch.randn(e, h, i, generator=g) * i**-0.5).to(DEVICE, dtype)
    weights, ids = sigmoid_topk_route(torch.randn(t, e, generator=g).to(DEVICE), None, k, True, 2.446)
    return x, w13, w2, weights, ids


def _ends(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(DEVICE, torch.int32)


@pytest.mark.parametrize(
    ("counts", "block_m"),
    [
        ([5, 0, 16, 17, 0, 1], 16),  # empty groups, a group of exactly one tile, one just past it
        ([0, 0, 0], 8),  # no rows at all: every slot unused
        ([100], 32),  # one expert, a ragged last tile
        ([3] * 40, 64),  # more experts than a program's slot block (32), each one short tile
        ([1] * 70 + [200, 0, 9], 8),  # 105 slots over 4 programs; a long group's tiles cross a program's block
    ],
)
def test_tile_map_cuts_each_group_into_row_tiles_in_expert_order(counts, block_m):
    want_e, want_row = [], []
    start = 0
    for e, c in enumerate(counts):
        for r in range(start, start + c, block_m):
            want_e.append(e)
            want_row.append(r)
        start += c
    tile_e, tile_row = tile_map(_ends(counts), sum(counts), block_m)
    slots = -(-sum(counts) // block_m) + len(counts)
    assert tile_e.shape == tile_row.shape == (slots,)
    live = len(want_e)
    assert tile_e[:live].tolist() == want_e and tile_row[:live].tolist() == want_row
    assert tile_e[live:].tolist() == [-1] * (slots - live)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("t", "e", "k", "h", "i", "tiles"),
    [
        (37, 8, 2, 64, 32, GemmTiles(16, 16, 32)),  # several tiles per expert, ragged last tiles
        (29, 16, 4, 96, 48, GemmTiles(16, 32, 64)),  # H and I not multiples of BLOCK_K / BLOCK_N: masked tails
        (3, 16, 2, 64, 32, GemmTiles(16, 16, 16)),  # most experts empty: their slots return at once
        (50, 4, 2, 64, 64, GemmTiles(32, 32, 32, num_warps=4, num_stages=2)),  # groups of several row tiles
    ],
)
def test_prefill_experts_match_the_definition(t, e, k, h, i, tiles, dtype):
    x, w13, w2, weights, ids = _problem(t, e, k, h, i, 3, dtype)
    ref = naive_moe(x.float(), weights, ids, w13[:, :i].float(), w13[:, i:].float(), w2.float())
    al = moe_align(ids, e)
    y = moe_experts_prefill(x, al, w13, w2, gate_up=tiles, down=tiles)
    assert y.shape == (t * k, h) and y.dtype == dtype
    out = moe_combine_triton(y, al.rows_of_pairs(), weights, dtype)
    assert_close("prefill experts", ref, out, tol(dtype) if dtype == torch.float32 else 1.5e-2)
    # each sorted row is its own expert's output: the experts swapped give another result
    wrong = moe_experts_prefill(x, al, w13.flip(0), w2.flip(0), gate_up=tiles, down=tiles)
    assert not torch.allclose(wrong.float(), y.float())


def test_prefill_experts_with_different_row_tiles_per_gemm():
    """The down GEMM may cut the rows in other tiles than the gate-up GEMM (its own tile map)."""
    x, w13, w2, _, ids = _problem(41, 6, 2, 64, 32, 4)
    al = moe_align(ids, 6)
    one = moe_experts_prefill(x, al, w13, w2, gate_up=GemmTiles(16, 16, 32), down=GemmTiles(16, 16, 32))
    two = moe_experts_prefill(x, al, w13, w2, gate_up=GemmTiles(16, 16, 32), down=GemmTiles(32, 32, 16))
    assert_close("down tiles", one, two, tol(torch.float32))


def test_prefill_experts_refuse_bad_shapes():
    x = torch.zeros(2, 64, device=DEVICE)
    al = moe_align(torch.zeros(2, 1, dtype=torch.int64, device=DEVICE), 4)
    with pytest.raises(ValueError, match="w2"):
        moe_experts_prefill(x, al, torch.zeros(4, 64, 64, device=DEVICE), torch.zeros(4, 64, 16, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        w13 = torch.zeros(4, 64, 64, device=DEVICE).transpose(1, 2)
        moe_experts_prefill(x, al, w13, torch.zeros(4, 64, 32, device=DEVICE))


def test_default_tiles_and_down_paths():
    """fp32 takes tiles whose pipeline fits in shared memory; the down GEMM's Triton kernel and the "auto"
    choice agree (auto is the Triton kernel where torch's grouped_mm cannot run, as on this host or for fp32)."""
    assert default_tiles(torch.float32) == (FP32_TILES, FP32_TILES)
    assert default_tiles(torch.bfloat16)[0] == GATE_UP_TILES
    i = 32
    x, w13, w2, weights, ids = _problem(33, 4, 2, 64, i, 6)
    ref = naive_moe(x, weights, ids, w13[:, :i], w13[:, i:], w2)
    al = moe_align(ids, 4)
    auto = moe_experts_prefill(x, al, w13, w2)
    assert_close("default tiles", ref, moe_combine_triton(auto, al.rows_of_pairs(), weights, x.dtype), tol(x.dtype))
    assert_close("triton down", auto, moe_experts_prefill(x, al, w13, w2, down_impl="triton"), tol(x.dtype))
    with pytest.raises(ValueError, match="down_impl"):
        moe_experts_prefill(x, al, w13, w2, down_impl="cublas")


def test_fit_stages_drops_pipeline_stages_to_the_shared_memory():
    """The H200's tiles as they are on the H200 (227 KB a block), one stage fewer on an A100 (164 KB), two
    stages on 100 KB parts (and never fewer), fp32 operands counted at 4 bytes."""
    h200, a100, small = 232448, 167936, 101376
    assert fit_stages(GATE_UP_TILES, 2, 2, h200) is GATE_UP_TILES  # 4 x 48 KB + headroom fit
    assert fit_stages(GATE_UP_TILES, 2, 2, a100).num_stages == 3
    assert fit_stages(GATE_UP_TILES, 2, 2, small).num_stages == 2
    assert fit_stages(DOWN_TILES, 1, 2, a100).num_stages == 3  # (128 x 64 + 256 x 64) x 2 B = 48 KB a stage
    assert fit_stages(FP32_TILES, 2, 4, small) is FP32_TILES  # 2 x 24 KB
    assert fit_stages(GemmTiles(128, 128, 64, num_stages=4), 2, 2, 1024).num_stages == 2
