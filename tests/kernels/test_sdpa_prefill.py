"""MLA prefill through torch SDPA for sequences with no prefix (kernels/paged_attention/sdpa_prefill.py and
its use in kernels/paged_attention/mla.py): the math against the naive reference on the CPU (SDPA's math
backend), which launches take it, and on a GPU cuDNN's kernel against the Triton path at real head sizes."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.nn.attention import SDPBackend

import kernels.paged_attention.mla as mla
import kernels.paged_attention.sdpa_prefill as sp
from kernels.paged_attention.meta import pack_block_tables
from kernels.paged_attention.mla import (
    gather_latent_rows,
    mla_self_attention_sdpa,
    paged_mla_attention_triton,
    plan_mla,
)
from kernels.paged_attention.naive import causal_attention, paged_mla_attention
from kernels.paged_attention.sdpa_prefill import KEYS_VALUES_WEIGHTS, mla_keys_values
from tests.kernels.helpers import DEVICE, ON_CUDA, assert_close, tol

MATH = SDPBackend.MATH


def _seqs(lens, h, d_qk, d_v, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    return (
        torch.randn(t, h, d_qk, generator=g),
        torch.randn(t, h, d_qk, generator=g),
        torch.randn(t, h, d_v, generator=g),
    )


def test_causal_self_attention_per_sequence():
    lens = [5, 1, 37]
    q, k, v = _seqs(lens, 3, 24, 16)
    out = sp.causal_self_attention(q, k, v, lens, 0.3, MATH)
    start = 0
    for n in lens:
        rows = slice(start, start + n)
        assert_close(f"rows {rows}", causal_attention(q[rows], k[rows], v[rows], 0.3), out[rows], tol(torch.float32))
        start += n


def test_causal_self_attention_rejects_bad_input():
    q, k, v = _seqs([4, 4], 2, 8, 8)
    with pytest.raises(ValueError, match="add up"):
        sp.causal_self_attention(q, k, v, [4, 3], 1.0, MATH)
    with pytest.raises(ValueError, match="positive"):
        sp.causal_self_attention(q, k, v, [8, 0], 1.0, MATH)
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        sp.causal_self_attention(q, k[:, :1], v, [4, 4], 1.0, MATH)


def test_mla_self_attention_matches_the_reference():
    """The expanded form's keys (k_nope from kv_b, k_pe shared by the heads) made whole for SDPA."""
    h, rank, rope, nope, vd, page_size = 4, 48, 16, 32, 24, 16
    lens = [29, 200, 3]
    g = torch.Generator().manual_seed(1)
    pages = [-(-n // page_size) for n in lens]
    latent_cache = torch.randn(sum(pages) + 1, page_size, rank + rope, generator=g)
    perm = torch.randperm(sum(pages), generator=g) + 1
    tables = list(perm.split(pages))
    kv_b = torch.randn(h * (nope + vd), rank, generator=g) * rank**-0.5
    qsl = [0, *torch.tensor(lens).cumsum(0).tolist()]
    q = torch.randn(qsl[-1], h, nope + rope, generator=g)
    scale = (nope + rope) ** -0.5
    ref = paged_mla_attention(q, latent_cache, qsl, lens, tables, kv_b, rank, nope, vd, scale)
    rows = gather_latent_rows(pack_block_tables(tables, torch.device("cpu")), lens, page_size)
    latent = latent_cache.view(-1, rank + rope)[rows]
    out = mla_self_attention_sdpa(q, latent, lens, kv_b, rank, nope, vd, scale, MATH)
    assert_close("o", ref, out, tol(torch.float32))


def _plan(q_lens, ctx, q_pos0=None, threshold=8):
    tables = [torch.arange(-(-c // 16)) for c in ctx]
    bt = pack_block_tables(tables, DEVICE)
    return plan_mla([0, *torch.tensor(q_lens).cumsum(0).tolist()], ctx, bt, 2, 16, 32, DEVICE, threshold, q_pos0=q_pos0)


def test_plan_marks_only_parts_whose_sequences_have_no_prefix():
    parts = _plan([20, 1, 33], [20, 40, 33])  # two first chunks (expanded), one decode row (absorbed)
    assert [(p.expanded, p.self_lens) for p in parts] == [(False, None), (True, (20, 33))]
    parts = _plan([20, 33], [20, 50])  # the second has a prefix: a launch of its own (the Triton kernel)
    assert [(p.expanded, p.self_lens, p.meta.num_seqs) for p in parts] == [(True, None, 1), (True, (20,), 1)]
    assert parts[0].rows.tolist() == list(range(20, 53)) and parts[1].rows.tolist() == list(range(20))
    parts = _plan([20], [40], q_pos0=[0])  # PCP's strided rows
    assert parts[0].self_lens is None
    parts = _plan([20, 33], [20, 33], threshold=None)  # all absorbed
    assert all(p.self_lens is None for p in parts)


def test_cudnn_path_only_on_cuda_in_16_bit(monkeypatch):
    assert not sp.cudnn_self_attention_usable(torch.bfloat16, torch.device("cpu"), 192, 128)
    assert not sp.cudnn_self_attention_usable(torch.float32, torch.device("cuda"), 192, 128)
    monkeypatch.setattr(sp, "MLA_PREFILL_SDPA", False)
    assert not sp.cudnn_self_attention_usable(torch.bfloat16, torch.device("cuda"), 192, 128)


@pytest.mark.parametrize("usable", [True, False])
def test_run_mla_takes_sdpa_for_self_attention_parts(monkeypatch, usable):
    """A batch of two first chunks, a chunk over a prefix and a decode row: with SDPA usable (its math
    backend here) the no-prefix part goes through it, the others through the Triton kernel; same result."""
    calls = []
    real = sp.causal_self_attention

    def spy(q, k, v, lens, scale, backend):
        calls.append(tuple(lens))
        return real(q, k, v, lens, scale, MATH)

    monkeypatch.setattr(mla, "causal_self_attention", spy)
    monkeypatch.setattr(mla, "cudnn_self_attention_usable", lambda *a: usable)
    h, rank, rope, nope, vd, page_size = 2, 32, 8, 16, 16, 16
    q_lens, ctx = [21, 1, 12, 9], [21, 30, 12, 40]
    g = torch.Generator().manual_seed(4)
    pages = [-(-c // page_size) + 1 for c in ctx]
    latent = torch.randn(sum(pages) + 1, page_size, rank + rope, generator=g).to(DEVICE)
    tables = list((torch.randperm(sum(pages), generator=g) + 1).split(pages))
    kv_b = (torch.randn(h * (nope + vd), rank, generator=g) * rank**-0.5).to(DEVICE)
    qsl = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    q = torch.randn(qsl[-1], h, nope + rope, generator=g).to(DEVICE)
    scale = (nope + rope) ** -0.5
    ref = paged_mla_attention(q, latent, qsl, ctx, tables, kv_b, rank, nope, vd, scale)
    # threshold 9: the 21 / 12-row first chunks and the 9-row chunk over a prefix are expanded
    out = paged_mla_attention_triton(q, latent, qsl, ctx, tables, kv_b, rank, nope, vd, scale, expand_min_q_len=9)
    assert calls == ([(21, 12)] if usable else [])  # the 9-row chunk has a prefix: a launch of its own
    assert_close("o", ref, out, tol(torch.float32))


@pytest.mark.skipif(not ON_CUDA, reason="cuDNN's fused attention needs a CUDA device")
def test_cudnn_matches_triton_at_kimi_head_sizes(monkeypatch):
    """Kimi-Linear's MLA heads (32 x (128 + 64), values 128, latent 512) in bf16: cuDNN vs the Triton path."""
    h, rank, rope, nope, vd, page_size = 32, 512, 64, 128, 128, 16
    assert sp.cudnn_self_attention_usable(torch.bfloat16, DEVICE, nope + rope, vd)
    q_lens = [1500, 700]
    g = torch.Generator(device=DEVICE).manual_seed(5)
    pages = [-(-n // page_size) for n in q_lens]
    latent = torch.randn(sum(pages) + 1, page_size, rank + rope, generator=g, device=DEVICE).bfloat16()
    tables = list((torch.randperm(sum(pages), generator=g, device=DEVICE) + 1).split(pages))
    kv_b = (torch.randn(h * (nope + vd), rank, generator=g, device=DEVICE) * rank**-0.5).bfloat16()
    qsl = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    q = torch.randn(qsl[-1], h, nope + rope, generator=g, device=DEVICE).bfloat16()
    scale = (nope + rope) ** -0.5
    args = (q, latent, qsl, q_lens, tables, kv_b, rank, nope, vd, scale)
    via_cudnn = paged_mla_attention_triton(*args)
    monkeypatch.setattr(sp, "MLA_PREFILL_SDPA", False)
    via_triton = paged_mla_attention_triton(*args)
    ref = paged_mla_attention(
        *(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    )
    assert_close("cudnn vs triton", via_triton, via_cudnn, 1e-2)
    assert_close("cudnn vs fp32 reference", ref, via_cudnn, 2e-2)


def test_keys_values_come_whole_out_of_one_gemm():
    """k_nope | k_pe | v per head from the stacked weight: k_pe exactly the latent's rope columns, k_nope and v
    the kv_b GEMM's."""
    h, rank, rope, nope, vd, t = 3, 40, 8, 16, 12, 37
    g = torch.Generator().manual_seed(2)
    latent = torch.randn(t, rank + rope, generator=g)
    kv_b = torch.randn(h * (nope + vd), rank, generator=g)
    k, v = mla_keys_values(latent, kv_b, h, rank, nope, vd)
    assert k.shape == (t, h, nope + rope) and v.shape == (t, h, vd)
    kv = (latent[:, :rank] @ kv_b.T).view(t, h, nope + vd)
    assert torch.equal(k[..., nope:], latent[:, None, rank:].expand(t, h, rope))
    assert_close("k_nope", kv[..., :nope], k[..., :nope], tol(torch.float32))
    assert_close("v", kv[..., nope:], v, tol(torch.float32))


def test_stacked_weight_follows_its_source():
    """Built once per weight; rebuilt after an in-place change (a reload) or for another key; dropped with the
    weight, so engines built and freed in one process do not keep their derived weights."""
    h, rank, rope, nope, vd = 2, 8, 4, 4, 4
    kv_b = torch.randn(h * (nope + vd), rank)
    before = len(KEYS_VALUES_WEIGHTS)
    latent = torch.randn(5, rank + rope)
    k1, _ = mla_keys_values(latent, kv_b, h, rank, nope, vd)
    w1 = KEYS_VALUES_WEIGHTS.get(kv_b, (h, rope, nope, vd, latent.dtype), lambda: pytest.fail("rebuilt"))
    assert len(KEYS_VALUES_WEIGHTS) == before + 1
    kv_b.mul_(2)  # in place: the version counter moves, the stale stacked weight must not be used
    k2, _ = mla_keys_values(latent, kv_b, h, rank, nope, vd)
    assert_close("k_nope doubled", 2 * k1[..., :nope], k2[..., :nope], tol(torch.float32))
    assert KEYS_VALUES_WEIGHTS.get(kv_b, (h, rope, nope, vd, latent.dtype), lambda: None) is not w1
    del kv_b, w1
    gc.collect()
    assert len(KEYS_VALUES_WEIGHTS) == before


def test_pack_weights_builds_the_stacked_weight_before_the_cache_is_sized(tiny_models, monkeypatch):
    """KimiMLAAttention.pack_weights (the engine packs before sizing the cache from free memory) builds each MLA
    layer's stacked weight where the cuDNN path will run; the forward then reuses it, built from that layer's
    kv_b weight."""
    from engine.models.kimi_linear import KimiMLAAttention
    from kernels.paged_attention.sdpa_prefill import build_keys_values_weight, keys_values_weight
    from tests.conftest import make_engine

    eng = make_engine(tiny_models["kimi_linear"])
    layers = [m for m in eng.model.modules() if isinstance(m, KimiMLAAttention)]
    assert layers
    monkeypatch.setattr(sp, "cudnn_self_attention_usable", lambda *a: True)
    eng.model.pack_weights()
    for m in layers:
        w, d = m.kv_b_proj.weight, m.dims
        dims = (m.num_heads, d.qk_rope_head_dim, d.qk_nope_head_dim, d.v_head_dim)
        got = KEYS_VALUES_WEIGHTS.get(w, (*dims, w.dtype), lambda: pytest.fail("not built by pack_weights"))
        assert torch.equal(got, build_keys_values_weight(w, *dims))
        assert keys_values_weight(w, *dims, w.dtype) is got
