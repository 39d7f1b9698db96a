"""kernels/short_conv/low_rank.py: KDA's f_b | g_b up-projections by extra programs of the short conv's launch,
against their contract (the batched GEMM) with the conv's own outputs and windows unchanged; argument errors; the
GPU backend's decode path against the reference backend; the tiny Kimi engine's tokens with it on and off."""

from __future__ import annotations

import pytest
import torch

from kernels.short_conv.low_rank import low_rank_args
from kernels.short_conv.naive import naive_low_rank_up
from kernels.short_conv.triton import LowRankUp, short_conv_update
from tests.kernels.helpers import DEVICE, ON_CUDA, assert_close


def _conv_case(n: int, c: int, p: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed + n + p + k)
    x = torch.randn(n, c, generator=g).to(DEVICE, dtype)
    weight = torch.randn(c, 4, generator=g).to(DEVICE, dtype)
    state = torch.randn(n + 3, c, 3, generator=g).to(DEVICE, dtype)
    packed = torch.randn(n, 2 * k + 9, generator=g).to(DEVICE, dtype)
    a = packed[:, 4 : 4 + 2 * k].view(n, 2, k)  # a column view of in_proj's output, as the model passes it
    b = (torch.randn(2, p, k, generator=g) / k**0.5).to(DEVICE, dtype)
    return x, weight, state, a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("n", "c", "p", "k"), [(1, 96, 64, 32), (3, 48, 200, 16), (20, 768, 96, 128), (1, 48, 512, 64)]
)
@pytest.mark.parametrize("planes", [1, 3])
def test_up_projections_in_the_conv_launch_match_the_contract(n, c, p, k, planes, dtype):
    x, weight, state, a, b = _conv_case(n, c, p, k, dtype)
    slots, qsl = [i + 1 for i in range(n)], list(range(n + 1))
    state_plain = state.clone()
    out = torch.full((2, n, p), float("nan"), dtype=dtype, device=DEVICE)
    y = short_conv_update(x, weight, state, slots, qsl, planes=planes, low_rank=LowRankUp(a, b, out))
    y_plain = short_conv_update(x, weight, state_plain, slots, qsl, planes=planes)
    assert torch.equal(y, y_plain) and torch.equal(state, state_plain)  # the conv's programs did as before
    want = naive_low_rank_up(a, b)
    assert_close("up-projections", want, out, 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_channel_cap_changes_programs_not_bits(dtype):
    x, weight, state, a, b = _conv_case(1, 96, 512, 128, dtype)
    outs = []
    for cap in (16, 64, 256):  # 256: the default
        out = torch.full((2, 1, 512), float("nan"), dtype=dtype, device=DEVICE)
        low_rank = LowRankUp(a, b, out, cap)
        assert low_rank_args(low_rank, 1, 1, x)[1]["LR_BLOCK_C"] == cap  # the cap reaches the launch
        short_conv_update(x, weight, state.clone(), [1], [0, 1], planes=3, low_rank=low_rank)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert_close("up-projections", naive_low_rank_up(a, b), outs[0], 1e-5 if dtype == torch.float32 else 1e-2)


def test_argument_errors():
    x, weight, state, a, b = _conv_case(2, 48, 64, 16, torch.float32)
    out = torch.empty(2, 2, 64, device=DEVICE)
    call = lambda lr: short_conv_update(x, weight, state, [0, 1], [0, 1, 2], low_rank=lr)
    with pytest.raises(ValueError, match="a must be"):
        call(LowRankUp(a[:1], b, out))
    with pytest.raises(ValueError, match="a must be"):
        call(LowRankUp(a, b[:, :, :8], out))
    with pytest.raises(ValueError, match="unit stride on K"):
        call(LowRankUp(a, b.transpose(1, 2).contiguous().transpose(1, 2), out))
    with pytest.raises(ValueError, match="out must be"):
        call(LowRankUp(a, b, out[:, :, :8]))
    with pytest.raises(ValueError, match="out must be"):
        call(LowRankUp(a, b, out.double()))
    with pytest.raises(ValueError, match="max_block_c must be a power of two in \\[16, 256\\], got 48"):
        call(LowRankUp(a, b, out, 48))


@pytest.mark.usefixtures("fla_unblocked")
@pytest.mark.parametrize(("q_lens", "ctx"), [([1], [9]), ([1, 1, 1], [5, 40, 17]), ([4, 1], [4, 30])])
def test_backend_decode_steps_take_the_fold_and_match_the_reference(q_lens, ctx, monkeypatch):
    """GPUKDABackend.low_rank_conv_recurrence vs the reference backend's (the batched GEMM, then its gated conv +
    recurrence): o, the output gate, windows and states; all-decode steps take the fold (the GEMM made to fail),
    a step with a prefill chunk does not."""
    import engine.backends.gpu_kda as gpu_kda
    from engine.backends.gpu import GPUKDABackend
    from engine.backends.torch_ref import TorchKDABackend
    from kernels.kda.naive import naive_chunk_kda_varlen
    from tests.kernels.test_gpu_backend import make_batch

    batch = make_batch(q_lens, ctx, 16, 64)
    h, kd, rank = 2, 16, 8
    gen = torch.Generator().manual_seed(len(ctx))
    conv = torch.randn(24, 3 * h * kd, 3, generator=gen).to(DEVICE)
    rec = (torch.randn(24, h, kd, kd, generator=gen) * 0.1).to(DEVICE)
    weight = torch.randn(3 * h * kd, 4, generator=gen).to(DEVICE)
    packed = torch.randn(batch.num_tokens, 3 * h * kd + 2 * rank + h, generator=gen).to(DEVICE)
    qkv, fg_a, logits = packed.split([3 * h * kd, 2 * rank, h], dim=-1)
    fg_b = (torch.randn(2, h * kd, rank, generator=gen) / rank**0.5).to(DEVICE)
    a_log, dt_bias = (torch.randn(h, generator=gen) * 0.5).to(DEVICE), torch.randn(h * kd, generator=gen).to(DEVICE)
    args = (fg_a.view(-1, 2, rank), fg_b, a_log, dt_bias, logits)
    conv_ref, rec_ref = conv.clone(), rec.clone()
    o_ref, gate_ref = TorchKDABackend().low_rank_conv_recurrence(qkv, conv_ref, weight, *args, rec_ref, batch)

    decode = all(q == 1 for q in q_lens)
    seen = []
    real = gpu_kda.short_conv_update
    monkeypatch.setattr(
        gpu_kda, "short_conv_update", lambda *a, **k: seen.append(k.get("low_rank") is not None) or real(*a, **k)
    )
    if decode:
        monkeypatch.setattr(torch, "bmm", lambda *a, **k: pytest.fail("an all-decode step ran the batched GEMM"))
    gpu = GPUKDABackend(chunk_fn=None if ON_CUDA else naive_chunk_kda_varlen)
    gpu.low_rank_max_rows = 4  # the kernel takes any rows; the engine's bound is a measured choice
    o, gate = gpu.low_rank_conv_recurrence(qkv, conv, weight, *args, rec, batch)
    monkeypatch.undo()
    assert seen == [decode]
    ratio = (2e-5 if decode else 5e-3) if ON_CUDA else 1e-5  # fla's chunk kernels for a prefill chunk: TF32
    assert_close("o", o_ref, o, ratio)
    assert_close("output gate", gate_ref, gate, 1e-5)
    assert_close("windows", conv_ref, conv, 1e-6)
    assert_close("states", rec_ref, rec, ratio)


@pytest.mark.usefixtures("fla_unblocked")
@pytest.mark.skipif(ON_CUDA, reason="CPU engine with interpreted kernels; bench/gpu_agreement.py covers the GPU")
@pytest.mark.parametrize("fold", [True, False], ids=["on", "off"])
def test_engine_tokens_with_the_fold_on_and_off(tiny_models, fold, monkeypatch):
    """Greedy tokens of the tiny Kimi model through the GPU backends, weights packed as on CUDA, batched and one
    sequence at a time: the reference's; with the fold on the one-row decode steps' KDA layers took it, off none."""
    import engine.backends.gpu_kda as gpu_kda
    from engine.sampling_params import SamplingParams
    from tests.conftest import make_engine, random_prompts
    from tests.kernels.test_gpu_backend import gpu_backends

    folds = []
    real = gpu_kda.short_conv_update
    monkeypatch.setattr(
        gpu_kda, "short_conv_update", lambda *a, **k: folds.append(k.get("low_rank") is not None) or real(*a, **k)
    )
    prompts = random_prompts(3, [23, 40, 9], seed=4)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ref = make_engine(tiny_models["kimi_linear"])
    eng = make_engine(tiny_models["kimi_linear"])
    eng.model.backends = gpu_backends()
    eng.model.backends.kda.low_rank_max_rows = 1 if fold else 0
    eng.model.pack_weights()
    want = [o.output_token_ids for o in ref.generate(prompts, params)]
    assert [o.output_token_ids for o in eng.generate(prompts, params)] == want
    assert eng.generate([prompts[0]], params)[0].output_token_ids == want[0]
    kda_layers = sum(1 for layer in eng.model.layers if type(layer.self_attn).__name__ == "KimiDeltaAttention")
    if fold:  # at least the single prompt's decode steps (the batch's have 3 rows: the GEMM, by the bound)
        assert sum(folds) >= (params.max_tokens - 1) * kda_layers > 0
    else:
        assert not any(folds) and folds
