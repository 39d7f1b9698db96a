"""kernels/gemv/norm_after.py: the post-attention norm run by the last program of the attention's one-row output
projection (the plain GEMV and KDA's gated-norm GEMV), against its contract (the projection as it stores its
output, then fla's add-norm numerics); the ticket put back after each launch and across graph replays; argument
errors; the dense backend's choice; the tiny engines' tokens with it on and off."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.gemv.gated_norm import gated_norm_gemv, gated_norm_gemv_norm_after
from kernels.gemv.naive import naive_gated_norm_gemv, naive_gemv, naive_gemv_norm_after
from kernels.gemv.norm_after import NormAfter
from kernels.gemv.triton import GemvTile, gemv, gemv_norm_after
from tests.kernels.helpers import DEVICE, ON_CUDA


def _inputs(n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed + n + 3 * k)
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    residual = (torch.randn(1, n, generator=g) * 3).to(DEVICE, dtype)
    norm_w = (torch.rand(n, generator=g) + 0.5).to(DEVICE, dtype)
    gate = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    gnorm_w = (torch.rand(32, generator=g) + 0.5).to(DEVICE, dtype)  # KDA's output norm over heads of 32
    return x, w, residual, norm_w, gate, gnorm_w


def _ticket() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=DEVICE)


def _check_pair(got, y, residual, norm_w, eps, dtype):
    """The pair against the contract on the projection's own output y (so the GEMV's sum order is not at
    stake): the residual sum is exact (bf16 within its last bit under the interpreter, whose casts may round
    otherwise than the GPU's round-to-nearest-even), the norm within the fp32 sum of squares' rounding."""
    want_out, want_res = naive_gemv_norm_after(y, residual, norm_w, eps)
    out, res = got
    assert out.dtype == dtype and res.dtype == residual.dtype and out.shape == res.shape == residual.shape
    if ON_CUDA or dtype == torch.float32:
        assert torch.equal(res, want_res)
    else:
        torch.testing.assert_close(res.float(), want_res.float(), rtol=2**-7, atol=1e-6)
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), want_out.float(), rtol=atol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("n", "k", "tile"), [(40, 64, None), (300, 96, GemvTile(8, 32)), (130, 256, GemvTile(16, 64))])
def test_gemv_norm_after_matches_the_contract(n, k, tile, dtype):
    x, w, residual, norm_w, _, _ = _inputs(n, k, dtype)
    ticket = _ticket()
    y = gemv(x, w, tile=tile)
    for _ in range(2):  # the second launch finds the ticket put back to 0
        got = gemv_norm_after(x, w, NormAfter(residual, norm_w, 1e-6, ticket), tile=tile)
        _check_pair(got, y, residual, norm_w, 1e-6, dtype)
        assert ticket.item() == 0
    # and y is the contract's projection
    torch.testing.assert_close(y.float(), naive_gemv(x, w).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("n", "k"), [(40, 128), (257, 256)])
def test_gated_norm_gemv_norm_after_matches_the_contract(n, k, dtype):
    x, w, residual, norm_w, gate, gnorm_w = _inputs(n, k, dtype, seed=5)
    ticket = _ticket()
    y = gated_norm_gemv(x, gate, gnorm_w, 1e-5, w)
    torch.testing.assert_close(
        y.float(), naive_gated_norm_gemv(x, gate, gnorm_w, 1e-5, w).float(), rtol=3e-2, atol=3e-2
    )
    for _ in range(2):
        got = gated_norm_gemv_norm_after(x, gate, gnorm_w, 1e-5, w, NormAfter(residual, norm_w, 1e-6, ticket))
        _check_pair(got, y, residual, norm_w, 1e-6, dtype)
        assert ticket.item() == 0


def test_the_norm_changes_with_the_residual_and_weight():
    """Not the projection alone: a different residual or norm weight gives a different pair."""
    x, w, residual, norm_w, _, _ = _inputs(64, 64, torch.float32, seed=9)
    ticket = _ticket()
    base = gemv_norm_after(x, w, NormAfter(residual, norm_w, 1e-6, ticket))
    other_res = gemv_norm_after(x, w, NormAfter(residual + 1, norm_w, 1e-6, ticket))
    other_w = gemv_norm_after(x, w, NormAfter(residual, norm_w * 2, 1e-6, ticket))
    assert not torch.allclose(base[1], other_res[1]) and not torch.allclose(base[0], other_res[0])
    assert torch.equal(base[1], other_w[1]) and torch.allclose(base[0] * 2, other_w[0])


def test_argument_errors():
    x, w, residual, norm_w, gate, gnorm_w = _inputs(40, 64, torch.float32)
    ticket = _ticket()
    with pytest.raises(ValueError, match="residual must be"):
        gemv_norm_after(x, w, NormAfter(residual[:, :8], norm_w, 1e-6, ticket))
    with pytest.raises(ValueError, match="residual must be"):
        gemv_norm_after(x, w, NormAfter(residual, norm_w[:8], 1e-6, ticket))
    with pytest.raises(ValueError, match="ticket must be an int32"):
        gemv_norm_after(x, w, NormAfter(residual, norm_w, 1e-6, ticket.long()))
    with pytest.raises(ValueError, match="one row"):
        gemv_norm_after(torch.cat([x, x]), w, NormAfter(residual, norm_w, 1e-6, ticket))
    with pytest.raises(ValueError, match="residual must be"):
        gated_norm_gemv_norm_after(x, gate, gnorm_w, 1e-5, w, NormAfter(residual.t(), norm_w, 1e-6, ticket))
    assert ticket.item() == 0


def test_dense_backend_fuses_one_row_steps_only(monkeypatch):
    from engine.backends.base import AddNorm
    from engine.backends.dense import TorchDense, TritonDense, gpu_dense_backend

    x, w, residual, norm_w, _, _ = _inputs(48, 64, torch.float32)
    an = AddNorm(residual, norm_w, 1e-6)
    on = TritonDense()
    assert on.fuses_norm_after(1) and not on.fuses_norm_after(2) and not on.fuses_norm_after(0)
    fused = on.linear_norm_after(x, w, an)
    assert fused is not None
    _check_pair(fused, gemv(x, w), residual, norm_w, 1e-6, torch.float32)
    assert on.linear_norm_after(torch.cat([x, x]), w, AddNorm(torch.cat([residual] * 2), norm_w, 1e-6)) is None
    assert on.linear_norm_after(x, w, AddNorm(residual[:, :8], norm_w, 1e-6)) is None  # the caller's norm then
    off = TritonDense(norm_after=False)
    assert not off.fuses_norm_after(1) and off.linear_norm_after(x, w, an) is None
    assert not TorchDense().fuses_norm_after(1) and TorchDense().linear_norm_after(x, w, an) is None

    monkeypatch.delenv("TANDEM_GEMV", raising=False)
    monkeypatch.delenv("TANDEM_GEMV_NORM_AFTER", raising=False)
    assert gpu_dense_backend().fuses_norm_after(1)  # on by default
    monkeypatch.setenv("TANDEM_GEMV_NORM_AFTER", "0")
    assert not gpu_dense_backend().fuses_norm_after(1)
    monkeypatch.setenv("TANDEM_GEMV_NORM_AFTER", "yes")
    with pytest.raises(ValueError, match="TANDEM_GEMV_NORM_AFTER must be 0 or 1"):
        gpu_dense_backend()


# ---- in the engine ------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("fla_unblocked")
@pytest.mark.skipif(ON_CUDA, reason="CPU engine with interpreted kernels; the GPU test below runs the real launch")
@pytest.mark.parametrize("arch", ["kimi_linear", "qwen3"])
@pytest.mark.parametrize("norm_after", [True, False], ids=["on", "off"])
def test_one_row_steps_run_the_post_attention_norm_in_o_proj(tiny_models, arch, norm_after):
    """Greedy tokens of the tiny models through the GPU backends and the skinny GEMM, one sequence at a time
    (every decode step one row), weights packed as on CUDA: the reference's, with the norm after o_proj on (it ran
    once per layer a decode step: the gated GEMV in KDA layers, the plain one in MLA and GQA layers; and the next
    norm after each dense MLP's down projection) and off."""
    from engine.backends.dense import TritonDense
    from engine.sampling_params import SamplingParams
    from tests.conftest import make_engine, random_prompts
    from tests.kernels.test_gpu_backend import gpu_backends

    dense = TritonDense(norm_after=norm_after)
    calls = {"gemv": 0, "gated": 0}
    plain, gated = dense._gemv_norm_after, dense._gated_norm_gemv_norm_after
    dense._gemv_norm_after = lambda *a, **k: calls.__setitem__("gemv", calls["gemv"] + 1) or plain(*a, **k)
    dense._gated_norm_gemv_norm_after = lambda *a, **k: calls.__setitem__("gated", calls["gated"] + 1) or gated(*a, **k)
    prompts = random_prompts(2, [23, 40], seed=8)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    ref = make_engine(tiny_models[arch])
    eng = make_engine(tiny_models[arch])
    eng.model.backends = dataclasses.replace(gpu_backends(), dense=dense)
    eng.model.pack_weights()
    for prompt in prompts:
        assert eng.generate([prompt], params)[0].output_token_ids == ref.generate([prompt], params)[0].output_token_ids
    decode_steps = len(prompts) * (params.max_tokens - 1)
    kda = sum(1 for layer in eng.model.layers if type(layer.self_attn).__name__ == "KimiDeltaAttention")
    others = len(eng.model.layers) - kda
    dense_mlps = sum(1 for layer in eng.model.layers if not getattr(layer, "is_moe", False))
    assert dense_mlps > 0  # Qwen3's every layer, the tiny Kimi's first: their down projections run the next norm
    plain = decode_steps * (others + dense_mlps)
    want = {"gemv": plain, "gated": decode_steps * kda} if norm_after else {"gemv": 0, "gated": 0}
    assert calls == want


@pytest.mark.skipif(not ON_CUDA, reason="the mid shape and CUDA graph replays need a GPU")
@pytest.mark.parametrize("gated", [False, True], ids=["gemv", "gated"])
def test_mid_shape_and_graph_replays_on_the_gpu(gated):
    """The mid model's o_proj (2304 x 4096, 288 programs) in bf16: each of 30 replays of one captured launch, with
    new inputs copied in before it, equals the eager launch on the same inputs; the ticket ends at 0."""
    torch.manual_seed(0)
    n, k = 2304, 4096
    x, w, residual = (
        torch.randn(1, k, device="cuda"),
        torch.randn(n, k, device="cuda") / 64,
        torch.randn(1, n, device="cuda"),
    )
    x, w, residual = x.bfloat16(), w.bfloat16(), residual.bfloat16()
    norm_w = (torch.rand(n, device="cuda") + 0.5).bfloat16()
    gate, gnorm_w = torch.randn(1, k, device="cuda").bfloat16(), (torch.rand(128, device="cuda") + 0.5).bfloat16()
    ticket = _ticket()

    def launch():
        after = NormAfter(residual, norm_w, 1e-6, ticket)
        if gated:
            return gated_norm_gemv_norm_after(x, gate, gnorm_w, 1e-5, w, after)
        return gemv_norm_after(x, w, after)

    y = gated_norm_gemv(x, gate, gnorm_w, 1e-5, w) if gated else gemv(x, w)
    _check_pair(launch(), y, residual, norm_w, 1e-6, torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = launch()
    for i in range(30):
        for t in (x, residual, gate):
            t.copy_(torch.randn_like(t, dtype=torch.float32).bfloat16() * (1 + i % 3))
        graph.replay()
        want_out, want_res = launch()
        assert torch.equal(res, want_res) and torch.equal(out, want_out), i
    assert ticket.item() == 0
