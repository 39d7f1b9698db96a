"""kernels/embed_norm: the embedding's row gather and the first layer's input norm in one launch, against its
contract (torch's gather, fla's norm numerics) and the separate pair the engine ran before; argument errors; the
norm backend's switch; the tiny engines' tokens with it on and off."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.embed_norm import naive_embed_rms_norm
from kernels.embed_norm.triton import embed_rms_norm
from kernels.gemv.naive import add_rms_norm_reference
from tests.kernels.helpers import DEVICE, ON_CUDA


def _inputs(v: int, n: int, t: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed + v + n + t)
    weight = (torch.randn(v, n, generator=g) * 2).to(DEVICE, dtype)
    ids = torch.randint(0, v, (t,), generator=g).to(DEVICE)
    norm_w = (torch.rand(n, generator=g) + 0.5).to(DEVICE, dtype)
    return weight, ids, norm_w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("v,n,t", [(97, 64, 1), (50, 40, 5), (300, 2304, 3), (16, 24, 0)])
def test_matches_the_contract(v, n, t, dtype):
    weight, ids, norm_w = _inputs(v, n, t, dtype)
    out, rows = embed_rms_norm(weight, ids, norm_w, 1e-6)
    want_out, want_rows = naive_embed_rms_norm(weight, ids, norm_w, 1e-6)
    assert out.shape == rows.shape == (t, n) and out.dtype == rows.dtype == dtype
    assert torch.equal(rows, want_rows)  # a copy of the rows, bit for bit
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want_out.float(), rtol=atol, atol=atol)


def test_the_contract_is_the_separate_gather_and_norm():
    """The naive form is what the model ran before: the rows, then the GPU norm's numerics on them (fla's
    add-norm with a zero residual is its plain norm)."""
    weight, ids, norm_w = _inputs(40, 48, 6, torch.float32)
    out, rows = naive_embed_rms_norm(weight.cpu(), ids.cpu(), norm_w.cpu(), 1e-5)
    rows_ref = weight.cpu()[ids.cpu()]
    normed, _ = add_rms_norm_reference(rows_ref, torch.zeros_like(rows_ref), norm_w.cpu(), 1e-5)
    assert torch.equal(rows, rows_ref)
    torch.testing.assert_close(out, normed, rtol=1e-6, atol=1e-6)


def test_ids_pick_rows_and_the_norm_weight_scales():
    """Each row is its own id's (a shuffled id order permutes the outputs), and the norm weight enters the output."""
    weight, ids, norm_w = _inputs(64, 32, 8, torch.float32, seed=3)
    out, rows = embed_rms_norm(weight, ids, norm_w, 1e-6)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out_p, rows_p = embed_rms_norm(weight, ids[perm], norm_w, 1e-6)
    assert torch.equal(rows_p, rows[perm]) and torch.equal(out_p, out[perm])
    out_2, _ = embed_rms_norm(weight, ids, norm_w * 2, 1e-6)
    torch.testing.assert_close(out_2, out * 2, rtol=1e-6, atol=1e-6)


def test_an_id_out_of_range_reads_no_memory():
    """The engine refuses such ids at add_request; the kernel still reads nothing for them (zero rows)."""
    weight, _, norm_w = _inputs(10, 16, 1, torch.float32)
    ids = torch.tensor([3, 10, -1, 9], device=DEVICE)
    out, rows = embed_rms_norm(weight, ids, norm_w, 1e-6)
    assert torch.equal(rows[0], weight[3]) and torch.equal(rows[3], weight[9])
    assert not rows[1:3].any() and not out[1:3].any()


def test_argument_errors():
    weight, ids, norm_w = _inputs(10, 16, 2, torch.float32)
    with pytest.raises(ValueError, match="weight must be"):
        embed_rms_norm(weight.t(), ids, norm_w, 1e-6)
    with pytest.raises(ValueError, match="ids must be"):
        embed_rms_norm(weight, ids.float(), norm_w, 1e-6)
    with pytest.raises(ValueError, match="ids must be"):
        embed_rms_norm(weight, ids[None], norm_w, 1e-6)
    with pytest.raises(ValueError, match="norm_weight must be"):
        embed_rms_norm(weight, ids, norm_w[:8], 1e-6)
    with pytest.raises(ValueError, match="norm_weight"):
        naive_embed_rms_norm(weight, ids, norm_w[:8], 1e-6)


@pytest.mark.usefixtures("fla_unblocked")
def test_norm_backend_switch(monkeypatch):
    from engine.backends.norm import FlaNormBackend, TorchNormBackend, gpu_norm_backend

    weight, ids, norm_w = _inputs(10, 16, 2, torch.float32)
    assert TorchNormBackend().embed_rms_norm(weight, ids, norm_w, 1e-6) is None
    assert FlaNormBackend(embed_norm=False).embed_rms_norm(weight, ids, norm_w, 1e-6) is None
    got = FlaNormBackend().embed_rms_norm(weight, ids, norm_w, 1e-6)
    assert got is not None and torch.equal(got[1], weight[ids])
    monkeypatch.delenv("TANDEM_EMBED_NORM", raising=False)
    assert gpu_norm_backend().embed_norm
    monkeypatch.setenv("TANDEM_EMBED_NORM", "0")
    assert not gpu_norm_backend().embed_norm
    monkeypatch.setenv("TANDEM_EMBED_NORM", "on")
    with pytest.raises(ValueError, match="TANDEM_EMBED_NORM must be 0 or 1"):
        gpu_norm_backend()


@pytest.mark.usefixtures("fla_unblocked")
@pytest.mark.skipif(ON_CUDA, reason="CPU engine with interpreted kernels; the GPU engine runs it in every bench step")
@pytest.mark.parametrize("arch", ["kimi_linear", "qwen3"])
@pytest.mark.parametrize("embed_norm", [True, False], ids=["on", "off"])
def test_engine_tokens_with_the_embedding_norm(tiny_models, arch, embed_norm):
    """Greedy tokens of the tiny models through the GPU backends (a batch, then one sequence at a time): the
    reference's, with the gather + first norm in one launch (once a forward: every prefill and decode step) and
    without it."""
    from engine.backends.norm import FlaNormBackend
    from engine.sampling_params import SamplingParams
    from tests.conftest import make_engine, random_prompts
    from tests.kernels.test_gpu_backend import gpu_backends

    norm = FlaNormBackend(embed_norm=embed_norm)
    calls, ran = [], []
    fused = norm.embed_rms_norm

    def counted(*args):
        out = fused(*args)
        calls.append(args[1].shape[0])
        ran.append(out is not None)
        return out

    norm.embed_rms_norm = counted
    prompts = random_prompts(3, [23, 40, 9], seed=5)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    ref = make_engine(tiny_models[arch])
    eng = make_engine(tiny_models[arch])
    eng.model.backends = dataclasses.replace(gpu_backends(), norm=norm)
    want = [o.output_token_ids for o in ref.generate(prompts, params)]
    assert [o.output_token_ids for o in eng.generate(prompts, params)] == want
    for prompt, w in zip(prompts, want, strict=True):
        assert eng.generate([prompt], params)[0].output_token_ids == w
    # every forward asks, fused or not: the batch's prefill and decode steps, then each prompt's
    assert len(calls) == (1 + len(prompts)) * params.max_tokens
    assert calls[0] == sum(len(p) for p in prompts) and 1 in calls and 3 in calls
    assert set(ran) == {embed_norm}
