"""The MLA decode kernel with the latent pages read through TMA (kernels/paged_attention/mla_decode_tma.py)
against the plain reference and the pointer kernel; on the CPU under the interpreter, which runs tensor
descriptors. Rows past each context and the unused page 0 hold NaN, so a masked row that reached the
probabilities' product would show."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention.mla_decode import mla_decode_fwd
from tests.kernels.helpers import DEVICE, assert_close, tol
from tests.kernels.test_mla_decode import _reference, _setup

CTX = [1, 5, 37, 100, 64]  # page- and tile-unaligned, one tile-aligned, mixed lengths in one batch


def _poisoned(ctx_lens, h, r, p, page_size, dtype=torch.float32, seed=0):
    q_lat, q_pe, latent, tables, bt, ctx_t = _setup(ctx_lens, h, r, p, page_size, dtype, seed)
    latent[0] = float("nan")
    for pages, ctx in zip(tables, ctx_lens, strict=True):
        flat = latent[pages.to(DEVICE)].flatten(0, 1)
        flat[ctx:] = float("nan")
        latent[pages.to(DEVICE)] = flat.view(len(pages), page_size, r + p)
    return q_lat, q_pe, latent, tables, bt, ctx_t


@pytest.mark.parametrize(("tile_pages", "keys_major"), [(1, False), (2, False), (1, True)])
@pytest.mark.parametrize("num_splits", [1, 2, 3])
@pytest.mark.parametrize(("h", "r", "p", "page_size"), [(3, 32, 16, 16), (8, 64, 16, 32)])
def test_matches_reference_and_pointer_kernel(tile_pages, keys_major, num_splits, h, r, p, page_size):
    q_lat, q_pe, latent, tables, bt, ctx_t = _poisoned(CTX, h, r, p, page_size)
    scale = (r + p) ** -0.5
    ref = _reference(q_lat, q_pe, latent, tables, CTX, scale)
    call = dict(num_splits=num_splits, block_n=page_size * tile_pages, keys_major=keys_major)
    out = mla_decode_fwd(q_lat, q_pe, latent, bt, ctx_t, max(CTX), scale, latent_tma=True, **call)
    assert out.dtype == torch.float32 and out.shape == q_lat.shape
    assert_close("o_lat vs reference", ref, out, tol(torch.float32))
    clean = torch.nan_to_num(latent, nan=0.0)  # the pointer kernel masks its loads; give it the same numbers
    pointer = mla_decode_fwd(q_lat, q_pe, clean, bt, ctx_t, max(CTX), scale, **call)
    assert_close("o_lat vs pointer kernel", pointer, out, 1e-5)


def test_bf16_loose_max_ctx_and_empty_sequence():
    """bf16, a max_ctx at the whole table (as a CUDA graph passes), and a sequence with no keys (zeros)."""
    ctx = [0, 33, 16]
    q_lat, q_pe, latent, tables, bt, ctx_t = _poisoned(ctx, 8, 64, 16, 16, dtype=torch.bfloat16, seed=2)
    scale = 80**-0.5
    out = mla_decode_fwd(
        q_lat, q_pe, latent, bt, ctx_t, bt.shape[1] * 16, scale, num_splits=2, block_n=32, latent_tma=True
    )
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[0].float().cpu(), torch.zeros(8, 64))
    assert_close("o_lat", _reference(q_lat, q_pe, latent, tables, ctx, scale)[1:], out[1:], 2e-2)


def test_refuses_what_tma_cannot_read():
    q_lat, q_pe, latent, _, bt, ctx_t = _setup([20, 9], 3, 32, 16, 8)
    with pytest.raises(ValueError, match="16 to 256 rows, got 8"):
        mla_decode_fwd(q_lat, q_pe, latent, bt, ctx_t, 20, 0.2, block_n=16, latent_tma=True)
    q_lat, q_pe, latent, _, bt, ctx_t = _setup([20, 9], 3, 32, 16, 16)
    call = (q_lat, q_pe, latent, bt, ctx_t, 20, 0.2)
    with pytest.raises(ValueError, match="1 or 2 whole pages of 16, got block_n=64"):
        mla_decode_fwd(*call, block_n=64, latent_tma=True)
    with pytest.raises(ValueError, match="keys-major takes one page a key tile: block_n=16, got 32"):
        mla_decode_fwd(*call, block_n=32, keys_major=True, latent_tma=True)
    wide = torch.zeros(latent.shape[0], 16, 32 + 16 + 1, device=DEVICE)
    with pytest.raises(ValueError, match="16-byte aligned"):
        mla_decode_fwd(q_lat, q_pe, wide[..., 1:], bt, ctx_t, 20, 0.2, block_n=16, latent_tma=True)
    q_odd, lat_odd = q_lat[..., :24].contiguous(), latent[..., 8:].contiguous()
    with pytest.raises(ValueError, match="powers of 2"):
        mla_decode_fwd(q_odd, q_pe, lat_odd, bt, ctx_t, 20, 0.2, block_n=16, latent_tma=True)


def test_measured_launch_is_taken_only_without_tuning(monkeypatch):
    """A cache the H200 sweep measured (pages of 64 on Hopper) takes its launch when the caller tunes nothing;
    any explicit option keeps the caller's launch. Here the measurement's gate is stood in for (no GPU)."""
    from kernels.paged_attention import mla_decode_tma

    q_lat, q_pe, latent, tables, bt, ctx_t = _poisoned([70, 3, 128], 4, 32, 16, 64, seed=5)
    assert mla_decode_tma.measured_launch(latent, 32, 16) is None  # not CUDA: the pointer kernel stays
    launches = []
    real_launch = mla_decode_tma.launch
    monkeypatch.setattr(
        mla_decode_tma, "measured_launch", lambda *a: dict(latent_tma=True, keys_major=True, block_n=64,
                                                           num_warps=8, num_stages=2)
    )  # fmt: skip
    monkeypatch.setattr(mla_decode_tma, "launch", lambda *a: launches.append(a[9:11]) or real_launch(*a))
    scale = 48**-0.5
    out = mla_decode_fwd(q_lat, q_pe, latent, bt, ctx_t, 128, scale)
    assert launches == [(64, True)]  # block_n, keys_major
    assert_close("o_lat", _reference(q_lat, q_pe, latent, tables, [70, 3, 128], scale), out, tol(torch.float32))
    mla_decode_fwd(q_lat, q_pe, torch.nan_to_num(latent), bt, ctx_t, 128, scale, block_n=32)
    assert len(launches) == 1
