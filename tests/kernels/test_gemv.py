"""kernels/gemv/triton.py (the skinny GEMM of decode-sized steps) vs naive_gemv (F.linear in fp32): one row (the
elementwise path) and 2-16 rows (the dot path), K and N off the tile, row-strided x, a given out, every tile the
sweep tries; on the GPU also the Kimi mid shapes and determinism."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv.gated_norm import gated_norm_gemv, gated_norm_gemv_fits
from kernels.gemv.naive import naive_gated_norm_gemv, naive_gemv
from kernels.gemv.triton import (
    GEMV_MAX_ROWS,
    ONE_ROW_TILES,
    GemvTile,
    gemv,
    gemv_tile,
    one_row_tile_overrides,
    parse_one_row_tiles,
)
from tests.kernels.helpers import DEVICE, ON_CUDA, assert_close, tol


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 7 * m + 31 * n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 64), (1, 33, 100), (2, 48, 96), (5, 37, 130), (16, 64, 512)])
def test_gemv_matches_linear(m, n, k, dtype):
    x, w = _operands(m, n, k, dtype)
    assert_close("gemv", naive_gemv(x, w), gemv(x, w), tol(dtype))


_TILES = [GemvTile(16, 32), GemvTile(32, 128, num_warps=8), GemvTile(64, 16, num_stages=2)]


@pytest.mark.parametrize(
    ("tile", "m"),
    # dot tiles (m > 1) need block_n >= 16; the one-row table's tiles on a small shape (K off their block_k)
    [(GemvTile(8, 64), 1)]
    + [(t, m) for t in _TILES for m in (1, 3)]
    + [(t, 1) for t in dict.fromkeys(ONE_ROW_TILES.values())],
    ids=lambda v: f"n{v.block_n}k{v.block_k}" if isinstance(v, GemvTile) else f"m{v}",
)
def test_every_tile_gives_the_same_product(tile, m):
    x, w = _operands(m, 50, 160, torch.float32)
    assert_close("gemv", naive_gemv(x, w), gemv(x, w, tile=tile), tol(torch.float32))


def test_strided_rows_and_out():
    x_wide, w = _operands(4, 24, 96, torch.float32)
    wide = torch.cat([x_wide, torch.zeros(4, 32, device=DEVICE)], dim=1)  # x as a column slice: row stride 128
    x = wide[:, :96]
    buf = torch.full((4, 40), 9.0, device=DEVICE)
    out = gemv(x, w, out=buf[:, 8:32])
    assert out.data_ptr() == buf[:, 8:].data_ptr()
    assert_close("gemv", naive_gemv(x_wide, w), buf[:, 8:32], tol(torch.float32))
    assert (buf[:, :8] == 9).all() and (buf[:, 32:] == 9).all()
    one = gemv(x[:1], w)
    assert_close("gemv", naive_gemv(x_wide[:1], w), one, tol(torch.float32))


def test_empty_and_zero_k():
    x, w = _operands(3, 5, 8, torch.float32)
    assert gemv(x[:0], w).shape == (0, 5)
    assert torch.equal(gemv(x[:, :0], w[:, :0]), torch.zeros(3, 5, device=DEVICE))


def test_validates():
    x, w = _operands(2, 16, 32, torch.float32)
    with pytest.raises(ValueError, match="share K"):
        gemv(x, w[:, :16])
    with pytest.raises(ValueError, match="dtype"):
        gemv(x, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="unit stride"):
        gemv(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match=f"at most {GEMV_MAX_ROWS} rows"):
        gemv(torch.zeros(GEMV_MAX_ROWS + 1, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, w, out=torch.empty(2, 15, device=DEVICE))
    with pytest.raises(ValueError, match="block_n must be >= 16"):
        gemv(x, w, tile=GemvTile(8, 32))


def test_default_tiles_fit_the_paths():
    for m in range(1, GEMV_MAX_ROWS + 1):
        for n, k in [(4096, 2304), (2304, 4096), *ONE_ROW_TILES]:
            t = gemv_tile(m, n, k)
            assert t.block_k >= 16 and (m == 1 or t.block_n >= 16)
    assert gemv_tile(1, 2304, 4096) == ONE_ROW_TILES[(2304, 4096)]


def test_one_row_tile_overrides_parse_refuse_and_apply(monkeypatch):
    """``TANDEM_GEMV_ONE_ROW_TILES`` names the one-row tile of each [N, K] it lists; other shapes and rows > 1
    keep theirs; bad text is refused with the variable's name."""
    want = {(2304, 4096): GemvTile(16, 1024, 8, 3), (40, 64): GemvTile(16, 32, 2, 2)}
    assert parse_one_row_tiles(" 2304x4096=16/1024/8/3, 40X64=16/32/2/2 ") == want
    assert parse_one_row_tiles("") == {}
    for bad in ("2304x4096", "2304=16/1024/8/3", "2304x4096=16/1024/8", "2304x4096=12/1024/8/3",
                "2304x4096=16/8/8/3", "0x4096=16/1024/8/3", "axb=16/1024/8/3", "2304x4096=16/1024/8/0"):  # fmt: skip
        with pytest.raises(ValueError, match="TANDEM_GEMV_ONE_ROW_TILES"):
            parse_one_row_tiles(bad)
    monkeypatch.setenv("TANDEM_GEMV_ONE_ROW_TILES", "40x64=16/32/2/2")
    one_row_tile_overrides.cache_clear()
    try:
        assert gemv_tile(1, 40, 64) == GemvTile(16, 32, 2, 2)
        assert (
            gemv_tile(2, 40, 64) == GemvTile(32, 128, 4, 4) and gemv_tile(1, 2304, 4096) == ONE_ROW_TILES[(2304, 4096)]
        )
        x, w = _operands(1, 40, 64, torch.float32)
        assert_close("gemv, override tile", naive_gemv(x, w), gemv(x, w), tol(torch.float32))
    finally:
        monkeypatch.delenv("TANDEM_GEMV_ONE_ROW_TILES")
        one_row_tile_overrides.cache_clear()
    assert gemv_tile(1, 40, 64) == GemvTile(16, 256, 4, 3)


@pytest.mark.skipif(not ON_CUDA, reason="Kimi mid shapes (19-85 MB weights): too slow for the interpreter")
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize(("n", "k"), [(12576, 2304), (2304, 4096), (6720, 2304), (18432, 2304), (2304, 9216)])
def test_mid_shapes_on_the_gpu(m, n, k):
    x, w = _operands(m, n, k, torch.bfloat16)
    out = gemv(x, w)
    assert_close("gemv", naive_gemv(x, w), out, tol(torch.bfloat16))
    assert torch.equal(out, gemv(x, w)), "the same launch twice must give the same bits"


def test_dense_backend_takes_decode_sized_steps_only():
    from engine.backends.dense import TorchDense, TritonDense

    dense = TritonDense(max_rows=4)
    x, w = _operands(6, 24, 64, torch.float32)
    assert_close("dense", naive_gemv(x[:4], w), dense.linear(x[:4], w), tol(torch.float32))
    assert torch.equal(dense.linear(x, w), TorchDense().linear(x, w))  # 6 rows > max_rows: F.linear itself
    with pytest.raises(ValueError, match="max_rows"):
        TritonDense(max_rows=GEMV_MAX_ROWS + 1)


def test_dense_backend_switch(monkeypatch):
    from engine.backends.dense import DENSE_GEMV_MAX_ROWS, TorchDense, TritonDense, gpu_dense_backend

    monkeypatch.setenv("TANDEM_GEMV", "0")
    assert type(gpu_dense_backend()) is TorchDense
    monkeypatch.setenv("TANDEM_GEMV", "1")
    be = gpu_dense_backend()
    assert isinstance(be, TritonDense) and be.max_rows == DENSE_GEMV_MAX_ROWS
    monkeypatch.setenv("TANDEM_GEMV", "yes")
    with pytest.raises(ValueError, match="TANDEM_GEMV must be 0 or 1"):
        gpu_dense_backend()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("n", "heads", "d"), [(40, 2, 32), (37, 3, 16), (24, 8, 8)])
def test_gated_norm_gemv_matches_two_steps(n, heads, d, dtype):
    """KDA's output norm inside the one-row GEMV (whole heads a K block; 3 heads: blocks of one head) vs the norm,
    rounded, then the product."""
    x, w = _operands(1, n, heads * d, dtype)
    gen = torch.Generator().manual_seed(n)
    gate = torch.randn(1, heads * d, generator=gen).to(DEVICE, dtype) * 3
    norm_w = (1 + 0.5 * torch.randn(d, generator=gen)).to(DEVICE, dtype)
    want = naive_gated_norm_gemv(x, gate, norm_w, 1e-6, w)
    assert_close("gated_norm_gemv", want, gated_norm_gemv(x, gate, norm_w, 1e-6, w), tol(dtype))


def test_gated_norm_gemv_rejects_what_it_cannot_fuse():
    x, w = _operands(2, 8, 64, torch.float32)
    norm_w = torch.ones(32, device=DEVICE)
    with pytest.raises(ValueError, match="gated_norm_gemv takes x, gate"):
        gated_norm_gemv(x, x, norm_w, 1e-6, w)  # two rows
    assert not gated_norm_gemv_fits(x[:1], x[:1], w, 24)  # head size not a power of two
    assert not gated_norm_gemv_fits(x[:1], x[:1, :32], w, 32)  # gate shorter than x
    assert gated_norm_gemv_fits(x[:1], x[1:], w, 32)
