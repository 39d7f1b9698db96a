"""kernels/short_conv/in_proj_conv.py: a KDA layer's in_proj GEMV and its short conv (with the up-projections) in
one launch at one token, against the two launches it replaces (``gemv`` then ``short_conv_update``) bit for bit;
the counters across launches and graph replays; bad input; the sm_90 build; the tiny engine's tokens with it."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv.triton import gemv
from kernels.short_conv.in_proj_conv import SYNC_WORDS, in_proj_conv
from kernels.short_conv.triton import LowRankUp, short_conv_update
from tests.kernels.helpers import DEVICE, ON_CUDA
from tests.kernels.sm90_compile import compile_errors, ptx_of, record_launches, registers_of


def _case(c: int, r: int, rest: int, k: int, p: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    w_in = (torch.randn(c + 2 * r + rest, k, generator=g) * k**-0.5).to(DEVICE, dtype)
    conv_w = torch.randn(c, 4, generator=g).to(DEVICE, dtype)
    state = torch.randn(5, c, 3, generator=g).to(DEVICE, dtype)
    fg_b = (torch.randn(2, p, r, generator=g) * r**-0.5).to(DEVICE, dtype)
    return x, w_in, conv_w, state, fg_b


def _two_launches(x, w_in, conv_w, state, slot, fg_b, planes=3):
    c, r = conv_w.shape[0], fg_b.shape[2]
    packed = gemv(x, w_in)
    up = packed.new_empty(2, 1, fg_b.shape[1])
    low = LowRankUp(packed[:, c : c + 2 * r].view(1, 2, r), fg_b, up)
    y = short_conv_update(packed[:, :c], conv_w, state, [slot], [0, 1], planes=planes, low_rank=low)
    return packed, y, up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("c", "r", "rest", "k", "p"), [(96, 16, 4, 64, 32), (768, 32, 8, 200, 256)])
def test_equals_the_two_launches(c, r, rest, k, p, dtype):
    """in_proj's output, the conv's planes, the up-projections and the updated window: the two launches' bits
    (the same program bodies on the same data), twice (the counters back at 0 in between)."""
    x, w_in, conv_w, state, fg_b = _case(c, r, rest, k, p, dtype, seed=c + k)
    sync = torch.zeros(SYNC_WORDS, dtype=torch.int32, device=DEVICE)
    slot = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    for step in range(2):
        want_state = state.clone()
        want = _two_launches(x, w_in, conv_w, want_state, 2, fg_b)
        got = in_proj_conv(x, w_in, c, conv_w, state, slot, fg_b, sync)
        for name, a, b in zip(("in_proj", "conv", "up-projections"), want, got, strict=True):
            assert torch.equal(a, b), f"{name} differs at launch {step}"
        assert torch.equal(state, want_state), "the conv window"
        assert not sync.any()
        x = torch.roll(x, 1, dims=1)


def test_a_padding_slot_leaves_the_state_and_still_projects():
    x, w_in, conv_w, state, fg_b = _case(48, 16, 4, 64, 32, torch.float32, seed=3)
    before = state.clone()
    sync = torch.zeros(SYNC_WORDS, dtype=torch.int32, device=DEVICE)
    packed, _, up = in_proj_conv(x, w_in, 48, conv_w, state, torch.tensor([-1], dtype=torch.int32, device=DEVICE),
                                 fg_b, sync)  # fmt: skip
    assert torch.equal(state, before) and not sync.any()
    assert torch.equal(packed, gemv(x, w_in)) and torch.isfinite(up).all()


def test_bad_inputs_say_what_is_wrong():
    x, w_in, conv_w, state, fg_b = _case(48, 16, 4, 64, 32, torch.float32, seed=1)
    sync = torch.zeros(SYNC_WORDS, dtype=torch.int32, device=DEVICE)
    slot = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"x \[1, 64\]"):
        in_proj_conv(x.expand(2, -1), w_in, 48, conv_w, state, slot, fg_b, sync)
    with pytest.raises(ValueError, match="must fit in_proj's 84 rows"):
        in_proj_conv(x, w_in, 60, conv_w, state, slot, fg_b, sync)
    with pytest.raises(ValueError, match="slot must be an int32"):
        in_proj_conv(x, w_in, 48, conv_w, state, slot.long(), fg_b, sync)
    with pytest.raises(ValueError, match=r"sync must be an int32 \[2\]"):
        in_proj_conv(x, w_in, 48, conv_w, state, slot, fg_b, sync[:1])
    with pytest.raises(ValueError, match="planes must divide"):
        in_proj_conv(x, w_in, 48, conv_w, state, slot, fg_b, sync, planes=5)
    assert not sync.any()


@pytest.mark.skipif(ON_CUDA, reason="records interpreted launches; on a GPU the tests above run the launch itself")
def test_compiles_for_sm90_at_kimis_shape():
    """Kimi's in_proj (12,576 x 2,304: 393 GEMV programs) and conv (12,288 channels, rank 128) in bf16, with no
    more registers than the GEMV's launch alone and no spills: the conv's programs must not cost the GEMV's
    programs their three-an-SM occupancy (``LOW_RANK_MAX_BLOCK_C``)."""
    x, w_in, conv_w, state, fg_b = _case(12288, 128, 32, 2304, 4096, torch.bfloat16, seed=2)
    sync = torch.zeros(SYNC_WORDS, dtype=torch.int32, device=DEVICE)
    with record_launches() as seen:
        in_proj_conv(x, w_in, 12288, conv_w, state, torch.tensor([1], dtype=torch.int32), fg_b, sync)
        gemv(x, w_in)
    launches = {x.kernel: x for x in seen}
    assert compile_errors(list(launches.values())) == []
    chained, alone = (registers_of(ptx_of(launches[k])) for k in ("_in_proj_conv_kernel", "_gemv_kernel"))
    assert chained[1] == 0 and chained[0] <= alone[0], (chained, alone)


@pytest.mark.skipif(not ON_CUDA, reason="a CUDA graph needs CUDA (the interpreter runs programs one by one)")
def test_counters_survive_graph_replays():
    """Programs really run concurrently here, at Kimi's shapes: every replay with a new token equals the two
    launches (the window carried from replay to replay), and the counters end at 0."""
    x, w_in, conv_w, state, fg_b = _case(12288, 128, 32, 2304, 4096, torch.bfloat16, seed=4)
    sync = torch.zeros(SYNC_WORDS, dtype=torch.int32, device=DEVICE)
    slot = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    want_state = state.clone()
    in_proj_conv(x, w_in, 12288, conv_w, state.clone(), slot, fg_b, sync)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = in_proj_conv(x, w_in, 12288, conv_w, state, slot, fg_b, sync)
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        x.copy_(torch.randn(x.shape, generator=gen).to(x))
        graph.replay()
        want = _two_launches(x, w_in, conv_w, want_state, 1, fg_b)
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(state, want_state)
    assert not sync.any()


# ---- in the engine ------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("fla_unblocked")
@pytest.mark.skipif(ON_CUDA, reason="CPU engine with interpreted kernels; bench/gpu_agreement.py covers the GPU")
@pytest.mark.parametrize("mode", ["on", "off", "torch-dense"])
def test_engine_tokens_with_the_launch_on_and_off(tiny_models, mode, monkeypatch):
    """Greedy tokens of the tiny Kimi model through the GPU backends, weights packed as on CUDA, batched and one
    sequence at a time: the reference's; on, every one-row decode step's KDA layers ran the one launch (and no
    batched step did), off none did, nor with the projection outside the skinny GEMM (a dense backend of
    ``F.linear``: the launch would change its bits). The backend's counters end at 0."""
    import dataclasses

    import engine.backends.gpu_kda as gpu_kda
    from engine.backends.dense import TritonDense
    from engine.sampling_params import SamplingParams
    from tests.conftest import make_engine, random_prompts
    from tests.kernels.test_gpu_backend import gpu_backends

    monkeypatch.setenv("TANDEM_KDA_IN_PROJ_CONV", "0" if mode == "off" else "1")
    rows = []
    real = gpu_kda.in_proj_conv
    monkeypatch.setattr(gpu_kda, "in_proj_conv", lambda x, *a, **k: rows.append(x.shape[0]) or real(x, *a, **k))
    prompts = random_prompts(3, [23, 40, 9], seed=6)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ref = make_engine(tiny_models["kimi_linear"])
    eng = make_engine(tiny_models["kimi_linear"])
    backends = gpu_backends()
    eng.model.backends = backends if mode == "torch-dense" else dataclasses.replace(backends, dense=TritonDense())
    eng.model.pack_weights()
    want = [o.output_token_ids for o in ref.generate(prompts, params)]
    assert [o.output_token_ids for o in eng.generate(prompts, params)] == want
    assert eng.generate([prompts[0]], params)[0].output_token_ids == want[0]
    kda_layers = sum(1 for layer in eng.model.layers if type(layer.self_attn).__name__ == "KimiDeltaAttention")
    if mode == "on":  # the single prompt's decode steps, one row each (the batch's had 3 rows: two launches)
        assert rows == [1] * ((params.max_tokens - 1) * kda_layers) and kda_layers > 0
        assert not eng.model.backends.kda._in_proj_sync.get(torch.device(DEVICE)).any()
    else:
        assert rows == []


@pytest.mark.usefixtures("fla_unblocked")
def test_the_backend_calls_back_between_the_launch_and_the_recurrence(monkeypatch):
    """``before_recurrence`` (the model's L2 prefetch of o_proj) runs after the one launch and before fla's
    recurrence, as it ran after in_proj in the two-launch path; steps the launch does not take return None."""
    from engine.backends.gpu import GPUKDABackend
    from kernels.kda.naive import naive_chunk_kda_varlen
    from tests.kernels.test_gpu_backend import make_batch

    monkeypatch.setenv("TANDEM_KDA_IN_PROJ_CONV", "1")
    h, kd, rank, hidden = 2, 16, 8, 32
    c = 3 * h * kd
    x, w_in, conv_w, _, fg_b = _case(c, rank, h, hidden, h * kd, torch.float32, seed=9)
    conv = torch.randn(8, c, 3).to(DEVICE)
    rec = torch.zeros(8, h, kd, kd).to(DEVICE)
    a_log, dt_bias = torch.zeros(h).to(DEVICE), torch.zeros(h * kd).to(DEVICE)
    gpu = GPUKDABackend(chunk_fn=naive_chunk_kda_varlen)
    order = []
    real = gpu.recurrence
    monkeypatch.setattr(gpu, "recurrence", lambda *a, **k: order.append("recurrence") or real(*a, **k))
    args = (x, w_in, c, conv, conv_w, fg_b, a_log, dt_bias, rec)
    out = gpu.project_low_rank_conv_recurrence(*args, make_batch([1], [9], 16, 8), lambda: order.append("callback"))
    assert out is not None and order == ["callback", "recurrence"]
    two_rows = make_batch([1, 1], [9, 5], 16, 8)
    assert gpu.project_low_rank_conv_recurrence(x.expand(2, -1), *args[1:], two_rows) is None
