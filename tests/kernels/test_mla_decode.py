"""All-heads MLA decode kernel (kernels/paged_attention/mla_decode.py) vs a plain torch reference and the
general paged-attention kernel's latent path."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention.meta import build_attn_meta, default_block_m, pack_block_tables
from kernels.paged_attention.mla_decode import mla_decode_fwd, mla_decode_splits
from kernels.paged_attention.triton import attention_fwd
from tests.kernels.helpers import DEVICE, assert_close, tol

CTX = [1, 5, 37, 100]  # page- and tile-unaligned, mixed lengths in one batch


def _setup(ctx_lens, h, r, p, page_size, dtype=torch.float32, seed=0):
    """Shuffled pages (one spare page per sequence, page 0 never used), packed int32 tables, queries."""
    g = torch.Generator().manual_seed(seed)
    n_pages = [-(-c // page_size) + 1 for c in ctx_lens]
    num_pages = sum(n_pages) + 1
    perm = torch.randperm(num_pages - 1, generator=g) + 1
    tables, used = [], 0
    for n in n_pages:
        tables.append(perm[used : used + n])
        used += n
    latent = torch.randn(num_pages, page_size, r + p, generator=g).to(dtype).to(DEVICE)
    q_lat = torch.randn(len(ctx_lens), h, r, generator=g).to(dtype).to(DEVICE)
    q_pe = torch.randn(len(ctx_lens), h, p, generator=g).to(dtype).to(DEVICE)
    bt = pack_block_tables(tables, DEVICE)
    ctx_t = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    return q_lat, q_pe, latent, tables, bt, ctx_t


def _reference(q_lat, q_pe, latent, tables, ctx_lens, scale):
    """softmax((q_lat c^T + q_pe pe^T) scale) c per sequence, fp32, keys gathered from the pages."""
    r = q_lat.shape[-1]
    out = torch.empty(q_lat.shape, dtype=torch.float32)
    for i, ctx in enumerate(ctx_lens):
        rows = latent.float().cpu()[tables[i]].flatten(0, 1)[:ctx]  # [ctx, R + P]
        c, pe = rows[:, :r], rows[:, r:]
        s = (q_lat[i].float().cpu() @ c.T + q_pe[i].float().cpu() @ pe.T) * scale  # [H, ctx]
        out[i] = torch.softmax(s, dim=-1) @ c
    return out


@pytest.mark.parametrize("keys_major", [False, True], ids=["heads_major", "keys_major"])
@pytest.mark.parametrize("num_splits", [1, 2, 3])
@pytest.mark.parametrize(("h", "r", "p", "page_size"), [(3, 32, 16, 4), (8, 64, 16, 16)])
def test_matches_reference(keys_major, num_splits, h, r, p, page_size):
    q_lat, q_pe, latent, tables, bt, ctx_t = _setup(CTX, h, r, p, page_size)
    scale = (r + p) ** -0.5
    ref = _reference(q_lat, q_pe, latent, tables, CTX, scale)
    out = mla_decode_fwd(
        q_lat, q_pe, latent, bt, ctx_t, max(CTX), scale, num_splits=num_splits, block_n=16, keys_major=keys_major
    )
    assert out.dtype == torch.float32 and out.shape == q_lat.shape
    assert_close("o_lat", ref, out, tol(torch.float32))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_padded_heads_tile_matches_reference(num_splits):
    """block_h above the heads (the 64-row tile Hopper's wgmma takes): padding rows read no query, write nothing."""
    h, r, p = 8, 64, 16
    q_lat, q_pe, latent, tables, bt, ctx_t = _setup(CTX, h, r, p, 16)
    scale = (r + p) ** -0.5
    ref = _reference(q_lat, q_pe, latent, tables, CTX, scale)
    out = torch.full_like(q_lat, float("nan"))
    mla_decode_fwd(
        q_lat, q_pe, latent, bt, ctx_t, max(CTX), scale, num_splits=num_splits, block_n=16, block_h=32, out=out
    )
    assert_close("o_lat", ref, out, tol(torch.float32))
    with pytest.raises(ValueError, match="block_h"):
        mla_decode_fwd(q_lat, q_pe, latent, bt, ctx_t, max(CTX), scale, block_h=4)


@pytest.mark.parametrize("keys_major", [False, True], ids=["heads_major", "keys_major"])
def test_matches_general_kernel(keys_major):
    """Same result as attention_fwd's latent path (mla.mla_absorbed's views), default tuning, non-power-of-2
    latent width, 32-key tiles over 4-key pages."""
    ctx, h, r, p, page_size = [37, 1, 100], 4, 48, 8, 4
    q_lat, q_pe, latent, tables, bt, ctx_t = _setup(ctx, h, r, p, page_size, seed=1)
    scale = 0.15
    meta = build_attn_meta([1] * len(ctx), ctx, h, default_block_m(h, 1, r), DEVICE, block_tables=bt)
    lat = latent[:, :, None, :]
    general = attention_fwd(q_lat, lat[..., :r], None, meta, scale, q_b=q_pe, k_b=lat[..., r:])
    out = mla_decode_fwd(q_lat, q_pe, latent, bt, ctx_t, max(ctx), scale, keys_major=keys_major)
    assert_close("vs general", general, out, tol(torch.float32))
    assert_close("vs reference", _reference(q_lat, q_pe, latent, tables, ctx, scale), out, tol(torch.float32))


@pytest.mark.parametrize("keys_major", [False, True], ids=["heads_major", "keys_major"])
def test_bf16(keys_major):
    q_lat, q_pe, latent, tables, bt, ctx_t = _setup(CTX, 8, 64, 16, 16, dtype=torch.bfloat16, seed=2)
    scale = 80**-0.5
    ref = _reference(q_lat, q_pe, latent, tables, CTX, scale)
    out = mla_decode_fwd(q_lat, q_pe, latent, bt, ctx_t, max(CTX), scale, num_splits=2, keys_major=keys_major)
    assert out.dtype == torch.bfloat16
    assert_close("o_lat", ref, out, 2e-2)


def test_strided_views_out_and_loose_max_ctx():
    """Non-contiguous q / latent views (as mla_absorbed slices them), a strided ``out``, and max_ctx a loose
    upper bound (the whole table, as a CUDA graph would pass) with a 64-key tile."""
    ctx, h, r, p, page_size = [20, 9], 3, 32, 16, 4
    q_lat, q_pe, latent, tables, bt, ctx_t = _setup(ctx, h, r, p, page_size, seed=3)
    wide = torch.zeros(latent.shape[0], page_size, r + p + 5, device=DEVICE)
    wide[..., : r + p] = latent
    q_all = torch.cat([q_lat, q_pe], dim=-1).transpose(0, 1).contiguous().transpose(0, 1)  # [B, H, R + P]
    out_buf = torch.full((len(ctx), h, r + 7), float("nan"), device=DEVICE)
    scale = 0.2
    for keys_major in (False, True):
        out = mla_decode_fwd(
            q_all[..., :r],
            q_all[..., r:],
            wide[..., : r + p],
            bt,
            ctx_t,
            bt.shape[1] * page_size,
            scale,
            num_splits=2,
            block_n=64,
            keys_major=keys_major,
            out=out_buf[..., :r],
        )
        assert out.data_ptr() == out_buf.data_ptr()
        assert_close("o_lat", _reference(q_lat, q_pe, latent, tables, ctx, scale), out, tol(torch.float32))
    assert torch.isnan(out_buf[..., r:]).all()  # nothing written past the view


@pytest.mark.parametrize(
    ("sms", "batch", "ctx", "want"),
    [
        (132, 64, 4096, 9),  # ~4 programs per SM
        (132, 64, 32768, 32),  # a split per 1024 keys (H200 sweep: 36 splits 1.25 ms, 9 splits 1.53 ms)
        (132, 16, 32768, 33),
        (132, 1, 32768, 256),  # capped: 128 keys per split at least
        (132, 64, 100, 1),
        (1, 4, 4096, 4),
        (1, 1, 600, 4),
        (1, 1, 255, 1),
        (1, 0, 0, 1),
    ],
)
def test_auto_splits(monkeypatch, sms, batch, ctx, want):
    import kernels.paged_attention.mla_decode as mod

    monkeypatch.setattr(mod, "_num_sms", lambda device: sms)
    assert mla_decode_splits(batch, ctx, torch.device("cpu")) == want


def test_rejects_bad_inputs():
    q_lat, q_pe, latent, _, bt, ctx_t = _setup([5, 9], 2, 32, 16, 4)
    args = (q_lat, q_pe, latent, bt, ctx_t, 9, 0.2)

    def call(i=None, value=None, **kw):
        a = list(args)
        if i is not None:
            a[i] = value
        return mla_decode_fwd(*a, **kw)

    with pytest.raises(ValueError, match="latent_cache"):
        call(2, latent[..., :-1])  # wrong latent width
    with pytest.raises(ValueError, match="agree"):
        call(1, q_pe[:1])
    with pytest.raises(ValueError, match="block_tables"):
        call(3, bt.long())
    with pytest.raises(ValueError, match="ctx_lens"):
        call(4, ctx_t[:1])
    with pytest.raises(ValueError, match="max_ctx"):
        call(5, bt.shape[1] * 4 + 1)
    with pytest.raises(ValueError, match="dtypes"):
        call(1, q_pe.double())
    with pytest.raises(ValueError, match="unit stride"):
        call(0, q_lat.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="block_n"):
        call(block_n=24)
    with pytest.raises(ValueError, match="num_splits"):
        call(num_splits=0)
    with pytest.raises(ValueError, match="out"):
        call(out=torch.empty(2, 2, 31, device=DEVICE))
    if DEVICE.type == "cuda":  # a compile Triton got wrong on the H200; the interpreter runs it exactly
        with pytest.raises(ValueError, match="num_stages"):
            call(keys_major=True, num_stages=1)
    else:
        want = call(keys_major=False)
        assert_close("keys-major, 1 stage (interpreter)", want, call(keys_major=True, num_stages=1), 1e-5)


@pytest.mark.parametrize("all_heads", [True, False])
def test_mla_wrapper_routes_decode_to_the_all_heads_kernel(monkeypatch, all_heads):
    """A decode batch (one query per sequence) through the MLA wrapper: the all-heads kernel when enabled (the
    default), the general kernel otherwise; both equal the naive expanded-form reference."""
    import kernels.paged_attention.mla as mla
    from kernels.paged_attention.naive import paged_mla_attention

    h, nope, rope, v, r, page = 4, 16, 8, 16, 32, 4
    _, _, latent, tables, _, _ = _setup(CTX, h, r, rope, page, seed=3)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(len(CTX), h, nope + rope, generator=g).to(DEVICE)
    kv_b = (torch.randn(h * (nope + v), r, generator=g) * r**-0.5).to(DEVICE)
    qsl = list(range(len(CTX) + 1))
    calls = []
    monkeypatch.setattr(mla, "MLA_ALL_HEADS", all_heads)
    monkeypatch.setattr(mla, "mla_decode_fwd", lambda *a, **k: calls.append(1) or mla_decode_fwd(*a, **k))
    args = (q, latent, qsl, CTX, tables, kv_b, r, nope, v, (nope + rope) ** -0.5)
    out = mla.paged_mla_attention_triton(*args)
    assert len(calls) == (1 if all_heads else 0)
    assert_close("mla", paged_mla_attention(*args), out, tol(torch.float32))
