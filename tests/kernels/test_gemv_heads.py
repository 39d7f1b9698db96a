"""kernels/gemv/heads.py: one row through a weight per head (MLA's W_UK and W_UV^T at one query), against its
contract; the tail columns FlashMLA's query takes; argument errors; MLA's absorbed decode at one query through it
and through the batched GEMMs it replaces, and the FlashMLA branch's query buffer."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv.heads import head_gemv
from kernels.gemv.naive import naive_head_gemv
from tests.kernels.helpers import DEVICE, assert_close, tol


def _rand(*shape, g, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "h,k,n,transposed",
    [(32, 128, 512, False), (32, 512, 128, True), (3, 20, 37, False), (5, 33, 7, True), (1, 1, 1, False)],
)
def test_matches_the_contract(h, k, n, transposed, dtype):
    """W_UK's layout (N contiguous) and W_UV^T's (a transposed view: K contiguous), real and odd shapes."""
    g = torch.Generator().manual_seed(h + k + n)
    x = _rand(h, k, g=g, dtype=dtype)
    w = (
        _rand(h, n, k, g=g, dtype=dtype, scale=k**-0.5).transpose(1, 2)
        if transposed
        else _rand(h, k, n, g=g, dtype=dtype, scale=k**-0.5)
    )
    got = head_gemv(x, w)
    want = naive_head_gemv(x, w)
    assert got.shape == (h, n) and got.dtype == dtype
    assert_close("head_gemv", want.float(), got.float(), 1e-5 if dtype == torch.float32 else 2e-2)


def test_out_view_and_tail_columns():
    """FlashMLA's query: the product into the first N columns of a wider [H, N + C] buffer, x a strided view of a
    packed projection, and the tail (the rope part) copied into the next C columns by the same launch."""
    g = torch.Generator().manual_seed(0)
    h, nope, rope, r = 4, 16, 8, 32
    q = _rand(1, h, nope + rope, g=g)  # the projection's [T, H, nope + rope]
    w = _rand(h, nope, r, g=g)
    buf = torch.full((h, r + rope), float("nan"), device=DEVICE)
    out = head_gemv(q[0, :, :nope], w, out=buf[:, :r], tail=q[0, :, nope:])
    assert out.data_ptr() == buf.data_ptr()
    assert_close("q_lat", naive_head_gemv(q[0, :, :nope], w), buf[:, :r], 1e-5)
    assert torch.equal(buf[:, r:], q[0, :, nope:])


def test_argument_errors():
    g = torch.Generator().manual_seed(1)
    x, w = _rand(4, 8, g=g), _rand(4, 8, 6, g=g)
    with pytest.raises(ValueError, match="x \\[H, K\\] and weight \\[H, K, N\\]"):
        head_gemv(x, w[:3])
    with pytest.raises(ValueError, match="unit column stride"):
        head_gemv(_rand(8, 4, g=g).t(), w)
    with pytest.raises(ValueError, match="x must be"):
        head_gemv(x.double(), w)
    with pytest.raises(ValueError, match="out must be"):
        head_gemv(x, w, out=torch.empty(4, 5, device=DEVICE))
    with pytest.raises(ValueError, match="no room"):
        head_gemv(x, w, out=torch.empty(4, 6, device=DEVICE), tail=_rand(4, 2, g=g))
    with pytest.raises(ValueError, match="x \\[H, K\\]"):
        naive_head_gemv(x, w[:3])


def _mla_inputs(t: int, seed: int):
    from tests.kernels.test_mla_decode import _setup

    h, nope, rope, v, r, page = 4, 16, 8, 16, 32, 4
    ctx = [5, 9, 17][:t]
    _, _, latent, tables, bt, _ = _setup(ctx, h, r, rope, page, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(ctx), h, nope + rope, generator=g).to(DEVICE)
    kv_b = (torch.randn(h * (nope + v), r, generator=g) * r**-0.5).to(DEVICE)
    return ctx, latent, tables, bt, q, kv_b, (h, nope, rope, v, r)


@pytest.mark.parametrize("t", [1, 3])
def test_mla_one_query_through_the_head_gemv(monkeypatch, t):
    """MLA's absorbed decode (the Triton branch): at one query both per-head products take the head GEMV (a batch
    keeps the batched GEMMs), and the output equals the batched GEMMs' and the naive expanded-form reference."""
    import kernels.paged_attention.mla as mla
    from kernels.paged_attention.naive import paged_mla_attention

    ctx, latent, tables, _, q, kv_b, (h, nope, rope, v, r) = _mla_inputs(t, seed=7)
    calls = []
    monkeypatch.setattr(mla, "head_gemv", lambda *a, **k: calls.append(a[1].shape) or head_gemv(*a, **k))
    args = (q, latent, list(range(t + 1)), ctx, tables, kv_b, r, nope, v, (nope + rope) ** -0.5)
    got = mla.paged_mla_attention_triton(*args)
    assert calls == ([(h, nope, r), (h, r, v)] if t == 1 else [])
    monkeypatch.setattr(mla, "MLA_HEAD_GEMV", False)
    assert_close("vs the batched GEMMs", mla.paged_mla_attention_triton(*args), got, tol(torch.float32))
    assert_close("vs the reference", paged_mla_attention(*args), got, tol(torch.float32))


def test_flashmla_query_buffer_at_one_query(monkeypatch):
    """The FlashMLA branch at one query (the kernel replaced by the Triton reference so it runs anywhere): its
    [1, H, 576] query holds q_nope . W_UK and q_pe, both written by the head GEMV's launch."""
    import kernels.paged_attention.mla as mla
    from kernels.paged_attention.meta import build_attn_meta
    from tests.kernels.test_mla_decode import _setup

    h, nope, rope, v, r, page = 4, 16, 64, 16, 512, 64
    ctx = [70]
    _, _, latent, _, bt, _ = _setup(ctx, h, r, rope, page, seed=5)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, h, nope + rope, generator=g).to(DEVICE)
    kv_b = (torch.randn(h * (nope + v), r, generator=g) * r**-0.5).to(DEVICE)
    meta = build_attn_meta([1], ctx, h, 16, DEVICE, block_tables=bt)
    seen, calls = [], []

    def fake(q_lat, q_pe, cache, block_tables, ctx_lens, scale, out=None, schedule=None, q=None):
        seen.append(q.clone())
        return mla.mla_decode_fwd(q_lat, q_pe, cache, block_tables, ctx_lens, max(ctx), scale)

    monkeypatch.setattr(mla, "use_flashmla", lambda cache, heads: True)
    monkeypatch.setattr(mla, "flashmla_decode_fwd", fake)
    monkeypatch.setattr(mla, "head_gemv", lambda *a, **k: calls.append(sorted(k)) or head_gemv(*a, **k))
    out = mla.mla_absorbed(q, latent, meta, kv_b, r, nope, v, 0.1)
    assert calls[0] == ["out", "tail"] and len(calls) == 2  # W_UK with the rope tail, then W_UV^T
    w_uk = kv_b.view(h, nope + v, r)[:, :nope]
    assert_close("q_lat", torch.einsum("thn,hnr->thr", q[..., :nope], w_uk), seen[0][..., :r], tol(torch.float32))
    assert torch.equal(seen[0][..., r:], q[..., nope:])
    monkeypatch.setattr(mla, "MLA_HEAD_GEMV", False)
    assert_close("vs the batched GEMMs", mla.mla_absorbed(q, latent, meta, kv_b, r, nope, v, 0.1), out, 1e-5)
