"""kernels/short_conv/planes.py: q | k | v conv + SiLU + per-head L2 norm in one launch, against the naive conv
and the naive L2 norm (under the interpreter on the host, the real kernel on CUDA); on CUDA also against the
path it replaces (fla's conv, then fla's ``l2norm_fwd``)."""

from __future__ import annotations

import pytest
import torch

from kernels.kda.naive import l2norm
from kernels.short_conv.fla_adapter import conv_step, short_conv_prefill_fla
from kernels.short_conv.naive import naive_short_conv
from kernels.short_conv.planes import conv_planes
from tests.kernels.helpers import DEVICE, assert_close, needs_cuda, tol


def _case(lens, init, c, hd, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w, slots = 4, [3, 0, 2, 5][: len(lens)]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    wide = torch.randn(qsl[-1], c + 8, generator=g).to(DEVICE, dtype)
    x = wide[:, 4 : 4 + c]  # the q|k|v column view of the packed projection, as the model passes it
    weight = torch.randn(c, w, generator=g).to(DEVICE, dtype)
    state = torch.randn(6, c, w - 1, generator=g).to(DEVICE, dtype)
    for s, has in zip(slots, init, strict=True):
        if not has:
            state[s] = float("nan")  # a fresh slot's junk must not leak into a first chunk
    return x, weight, state, slots, qsl


def _reference(x, weight, state, slots, qsl, init, planes, hd, norm_planes):
    ys = []
    for i, s in enumerate(slots):
        ys.append(naive_short_conv(x[qsl[i] : qsl[i + 1]], weight, state[s] if init[i] else None)[0])
    y = torch.cat(ys)  # [T, C] in x's dtype (the conv output a separate norm would read)
    out = list(y.float().chunk(planes, dim=1))
    for j in range(norm_planes):
        out[j] = l2norm(out[j].unflatten(1, (-1, hd))).flatten(1)
    return [o.to(x.dtype) for o in out]


@pytest.mark.parametrize(
    ("lens", "init"),
    [([300, 2, 65], [True, False, True]), ([130, 64, 1], [False, False, True]), ([1, 200], [True, True])],
    ids=["mixed", "first-chunks", "short-window"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_t", [4, 16, 64])  # rows a sub-tile: 4 puts the window's rows in one sub-tile
def test_planes_match_the_naive_conv_then_l2norm(lens, init, dtype, block_t):
    planes, hd = 3, 16
    x, weight, state, slots, qsl = _case(lens, init, planes * 2 * hd, hd, dtype)
    before = state.clone()
    step = conv_step(slots, qsl, init, DEVICE)
    out = conv_planes(x, weight, state, step, planes=planes, head_dim=hd, norm_planes=2, block_t=block_t)
    ref = _reference(x, weight, state, slots, qsl, init, planes, hd, 2)
    assert len(out) == planes
    for name, r, o in zip("qkv", ref, out, strict=True):
        assert o.is_contiguous() and o.shape == r.shape
        assert_close(name, r, o, tol(dtype))
    q = out[0].float().unflatten(1, (-1, hd))
    assert torch.allclose(q.norm(dim=-1), torch.ones(()), atol=2e-2)  # normed per head, not per plane
    assert torch.equal(state.nan_to_num(7.0), before.nan_to_num(7.0))  # windows are the caller's to write


def test_unnormed_planes_are_the_plain_conv():
    x, weight, state, slots, qsl = _case([70, 3], [True, False], 64, 16, torch.float32, seed=3)
    step = conv_step(slots, qsl, [True, False], DEVICE)
    out = conv_planes(x, weight, state, step, planes=2, head_dim=16, norm_planes=0)
    ref = _reference(x, weight, state, slots, qsl, [True, False], 2, 16, 0)
    for r, o in zip(ref, out, strict=True):
        assert_close("y", r, o, tol(torch.float32))


def test_refuses_heads_that_do_not_tile_the_planes():
    x, weight, state, slots, qsl = _case([5], [True], 48, 16, torch.float32)
    step = conv_step(slots, qsl, [True], DEVICE)
    with pytest.raises(ValueError, match="heads"):
        conv_planes(x, weight, state, step, planes=3, head_dim=32)
    with pytest.raises(ValueError, match="power of two"):
        conv_planes(x, weight, state, step, planes=1, head_dim=48)
    with pytest.raises(ValueError, match="block_t"):
        conv_planes(x, weight, state, step, planes=3, head_dim=16, block_t=2)  # the window needs W-1 = 3 rows
    with pytest.raises(ValueError, match="conv_state"):
        conv_planes(x, weight, state[:, :16], step, planes=3, head_dim=16)


@needs_cuda
@pytest.mark.parametrize("lens", [[8192], [3000, 64, 900]])
def test_planes_equal_flas_conv_then_l2norm_on_cuda(lens, fla_unblocked):
    """The path it replaces, at Kimi's head size: fla's conv per plane, then fla's l2norm_fwd on q and k."""
    from fla.modules.norm.l2norm import l2norm_fwd

    init = [True, False, True][: len(lens)]
    planes, hd = 3, 128
    x, weight, state, slots, qsl = _case(lens, init, planes * 4 * hd, hd, torch.bfloat16, seed=5)
    step = conv_step(slots, qsl, init, DEVICE)
    out = conv_planes(x, weight, state, step, planes=planes, head_dim=hd)
    ref = list(short_conv_prefill_fla(x, weight, state.clone(), step, planes=planes))
    for j in range(2):
        ref[j] = l2norm_fwd(ref[j].unflatten(1, (-1, hd)))[0].flatten(1)
    for name, r, o in zip("qkv", ref, out, strict=True):
        mismatch = (r != o).float().mean().item()
        assert mismatch < 1e-2, f"{name}: {mismatch:.2%} of elements differ"  # tap order / rounding ties only
        assert_close(name, r, o, tol(torch.bfloat16))


PLANES_SCENARIOS = {
    # prefill-only steps: first and continued chunks across 64-token tiles; rungs misaligned (the chunk is
    # cut), aligned and at a chunk's end (their windows copied before the planes read the old ones)
    "prefill": dict(q_lens=[150, 40, 64], ctx=[170, 40, 128], cks=None),
    "checkpoints": dict(q_lens=[150, 64], ctx=[170, 128], cks=[((64, 20), (128, 21)), ((128, 23),)]),
}


@pytest.mark.usefixtures("fla_unblocked")
@pytest.mark.parametrize("scenario", list(PLANES_SCENARIOS))
def test_conv_recurrence_through_the_planes_matches_the_reference(scenario, monkeypatch):
    """GPUKDABackend.conv_recurrence on a long prefill step (bound lowered to 16 tokens): the planes kernel
    runs, the recurrence does not norm q / k again, and o, the windows (rungs included) and the recurrent
    states equal TorchKDABackend's."""
    import engine.backends.gpu_kda as gpu_kda
    from engine.backends.gpu import GPUKDABackend
    from engine.backends.torch_ref import TorchKDABackend
    from kernels.kda.naive import kda_gate, naive_chunk_kda_varlen
    from tests.kernels.test_gpu_backend import make_batch

    ran = []
    monkeypatch.setattr(gpu_kda, "conv_planes", lambda *a, **kw: ran.append(1) or conv_planes(*a, **kw))
    sc = PLANES_SCENARIOS[scenario]
    batch = make_batch(sc["q_lens"], sc["ctx"], 16, 64, checkpoints=sc["cks"])
    h, kd, w = 2, 16, 4
    gen = torch.Generator().manual_seed(2)
    conv = torch.randn(24, 3 * h * kd, w - 1, generator=gen).to(DEVICE)
    rec = (torch.randn(24, h, kd, kd, generator=gen) * 0.1).to(DEVICE)
    weight = torch.randn(3 * h * kd, w, generator=gen).to(DEVICE)
    x = torch.randn(batch.num_tokens, 3 * h * kd + 8, generator=gen).to(DEVICE)[:, 4:-4]
    g = kda_gate(torch.randn(batch.num_tokens, h * kd, generator=gen), torch.zeros(h), torch.zeros(h * kd), kd)
    g, beta = g.to(DEVICE), torch.rand(batch.num_tokens, h, generator=gen).to(DEVICE)
    gpu = GPUKDABackend(chunk_fn=None if DEVICE.type == "cuda" else naive_chunk_kda_varlen, planes_min_len=16)
    conv_ref, rec_ref = conv.clone(), rec.clone()
    for layer in range(2):  # the second layer reuses the step's conv tables
        o_ref = TorchKDABackend().conv_recurrence(x, conv_ref, weight, g, beta, rec_ref, batch)
        o = gpu.conv_recurrence(x, conv, weight, g, beta, rec, batch)
        ratio = 1e-5 if DEVICE.type != "cuda" else 5e-3  # fla's chunk kernels use TF32 dots on the GPU
        assert_close(f"o, layer {layer}", o_ref, o, ratio)
        assert_close(f"windows, layer {layer}", conv_ref, conv, 1e-6)
        assert_close(f"states, layer {layer}", rec_ref, rec, ratio)
    assert len(ran) == 2


def test_steps_with_decode_rows_or_short_chunks_keep_the_separate_norms(monkeypatch):
    """On by default (``TANDEM_KDA_CONV_PLANES=0``, read at import, turns it off), prefill-only steps with a
    long chunk."""
    import engine.backends.gpu_kda as gpu_kda
    from engine.backends.gpu import GPUKDABackend
    from tests.kernels.test_gpu_backend import make_batch

    assert GPUKDABackend().planes_min_len == gpu_kda.PLANES_MIN_LEN
    monkeypatch.setattr(gpu_kda, "CONV_PLANES", False)
    assert GPUKDABackend().planes_min_len is None
    monkeypatch.undo()

    be = GPUKDABackend(planes_min_len=64)
    for q_lens, ctx, fits in [([100, 1], [100, 9], False), ([40, 30], [40, 30], False), ([100, 3], [100, 3], True)]:
        batch = make_batch(q_lens, ctx, 16, 64)
        x = torch.zeros(batch.num_tokens, 96, device=DEVICE)
        assert be._planes_fit(x, batch, be._meta(batch, x.device), 16) is fits, (q_lens, ctx)
    off = GPUKDABackend(planes_min_len=None)
    batch = make_batch([100], [100], 16, 64)
    assert not off._planes_fit(torch.zeros(100, 96, device=DEVICE), batch, off._meta(batch, DEVICE), 16)


@pytest.mark.usefixtures("fla_unblocked")
@pytest.mark.parametrize("gate_in_chunk", [False, True], ids=["gate_kernel", "gate_in_chunk"])
def test_engine_tokens_through_the_planes_match_the_reference(tiny_models, monkeypatch, gate_in_chunk):
    """The tiny Kimi on the GPU backends (fp32; on CUDA the engine runs there) with the planes bound at 16
    tokens: a 300-token prompt in 128-token chunks (continued chunks read their windows from the slots) and
    three prompts in one step; greedy tokens == the CPU reference backends'. With ``gate_in_chunk`` the
    prefill-only steps hand the chunk function the raw gate (fla's fused gate + cumsum on CUDA)."""
    import engine.backends.gpu_kda as gpu_kda
    from engine.backends import Backends
    from engine.backends.gpu import GPUAttentionBackend, GPUKDABackend, GPUMoEBackend
    from engine.sampling_params import SamplingParams
    from kernels.kda.naive import naive_chunk_kda_varlen
    from tests.conftest import make_engine, random_prompts

    ran, raw_gates = [], []
    monkeypatch.setattr(gpu_kda, "conv_planes", lambda *a, **kw: ran.append(1) or conv_planes(*a, **kw))
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    inner_chunk = gpu_kda.chunk_kda_varlen if DEVICE.type == "cuda" else naive_chunk_kda_varlen

    def chunk_fn(*a, **kw):
        raw_gates.append("gate" in kw)
        return inner_chunk(*a, **kw)

    kw = dict(device="cuda", dtype="float32") if DEVICE.type == "cuda" else {}
    for lens, budget in (([300], 128), ([70, 9, 130], 256)):
        prompts = random_prompts(len(lens), lens, seed=8)
        ref = make_engine(tiny_models["kimi_linear"], max_num_batched_tokens=budget)
        eng = make_engine(tiny_models["kimi_linear"], max_num_batched_tokens=budget, **kw)
        kda = GPUKDABackend(chunk_fn=chunk_fn, planes_min_len=16, gate_in_chunk=gate_in_chunk)
        eng.model.backends = Backends(GPUAttentionBackend(), kda, GPUMoEBackend())
        expected = [o.output_token_ids for o in ref.generate(prompts, params)]
        assert [o.output_token_ids for o in eng.generate(prompts, params)] == expected, lens
    assert ran  # the path under test ran
    assert raw_gates and all(raw_gates) == any(raw_gates) == gate_in_chunk  # every chunk call (decode: no chunk call)


GATED_SCENARIOS = {
    "prefill, planes": dict(q_lens=[150, 40, 64], ctx=[170, 40, 128], planes=True),
    "prefill, short chunks": dict(q_lens=[12, 9], ctx=[12, 30], planes=False),
    "mixed: decode rows keep the gate kernel": dict(q_lens=[150, 1, 1], ctx=[170, 9, 33], planes=True),
}


@pytest.mark.usefixtures("fla_unblocked")
@pytest.mark.parametrize("scenario", list(GATED_SCENARIOS))
def test_gated_conv_recurrence_with_the_gate_in_the_chunk_matches_the_reference(scenario):
    """GPUKDABackend(gate_in_chunk=True).gated_conv_recurrence: prefill-only steps hand the chunk function the raw
    gate projection (with and without the planes), steps with decode rows gate first; o, windows and states as
    TorchKDABackend's (which gates, then runs the recurrence)."""
    from engine.backends.gpu import GPUKDABackend
    from kernels.kda.naive import naive_chunk_kda_varlen
    from tests.kernels.test_gpu_backend import make_batch

    sc = GATED_SCENARIOS[scenario]
    raw = []
    inner = None if DEVICE.type == "cuda" else naive_chunk_kda_varlen

    def chunk_fn(*a, **kw):
        raw.append("gate" in kw)
        from engine.backends.gpu_kda import chunk_kda_varlen

        return (inner or chunk_kda_varlen)(*a, **kw)

    batch = make_batch(sc["q_lens"], sc["ctx"], 16, 64)
    gpu = GPUKDABackend(chunk_fn=chunk_fn, planes_min_len=16 if sc["planes"] else None, gate_in_chunk=True)
    _gated_matches_reference(gpu, batch, seed=4, ratio=1e-5 if DEVICE.type != "cuda" else 5e-3)  # TF32 on the GPU
    mixed = 1 in sc["q_lens"]
    assert raw and all(raw) != mixed  # prefill-only: the raw gate went in; mixed: gated before the chunk call


@pytest.mark.usefixtures("fla_unblocked")
@pytest.mark.parametrize("in_kernel", [True, False], ids=["gate_in_kernel", "gate_first"])
@pytest.mark.parametrize("ctx", [[5, 40, 17], [1], [300, 2]], ids=["three", "one_token_prompt", "two"])
def test_decode_step_with_the_gate_in_the_recurrent_kernel_matches_the_reference(ctx, in_kernel, monkeypatch):
    """All-decode steps: GPUKDABackend(decode_gate_in_kernel=True) hands fla's recurrent kernel the raw gate and
    beta's logits (neither the gate kernel nor a sigmoid runs: ``gate`` and torch.sigmoid are made to fail);
    o, windows and states as TorchKDABackend's. A one-token prompt is a decode row from a zeroed slot."""
    from engine.backends.gpu import GPUKDABackend
    from tests.kernels.test_gpu_backend import make_batch

    batch = make_batch([1] * len(ctx), ctx, 16, 64, has_init=[c > 1 for c in ctx])
    gpu = GPUKDABackend(decode_gate_in_kernel=in_kernel)
    forbid = None
    if in_kernel:

        def forbid():
            def fail(*a, **k):
                raise AssertionError("the fused decode path gated / took the sigmoid outside the kernel")

            monkeypatch.setattr(gpu, "gate", fail)
            monkeypatch.setattr(torch, "sigmoid", fail)

    _gated_matches_reference(gpu, batch, seed=7, ratio=1e-5 if DEVICE.type != "cuda" else 2e-5, before_gpu=forbid)
    monkeypatch.undo()


def _gated_matches_reference(gpu, batch, seed: int, ratio: float, before_gpu=None) -> None:
    """``gpu.gated_conv_recurrence`` vs TorchKDABackend's on random inputs (the q|k|v columns a strided view, as
    the packed projection gives them): o, conv windows and states. before_gpu: called between the two."""
    from engine.backends.torch_ref import TorchKDABackend

    h, kd, w = 2, 16, 4
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randn(24, 3 * h * kd, w - 1, generator=gen).to(DEVICE)
    rec = (torch.randn(24, h, kd, kd, generator=gen) * 0.1).to(DEVICE)
    weight = torch.randn(3 * h * kd, w, generator=gen).to(DEVICE)
    x = torch.randn(batch.num_tokens, 3 * h * kd + 8, generator=gen).to(DEVICE)[:, 4:-4]
    g_raw = torch.randn(batch.num_tokens, h * kd, generator=gen).to(DEVICE)
    a_log, dt_bias = (torch.randn(h, generator=gen) * 0.5).to(DEVICE), torch.randn(h * kd, generator=gen).to(DEVICE)
    logits = torch.randn(batch.num_tokens, h, generator=gen).to(DEVICE)  # beta's
    conv_ref, rec_ref = conv.clone(), rec.clone()
    o_ref = TorchKDABackend().gated_conv_recurrence(x, conv_ref, weight, g_raw, a_log, dt_bias, logits, rec_ref, batch)
    if before_gpu is not None:
        before_gpu()
    o = gpu.gated_conv_recurrence(x, conv, weight, g_raw, a_log, dt_bias, logits, rec, batch)
    assert_close("o", o_ref, o, ratio)
    assert_close("windows", conv_ref, conv, 1e-6)
    assert_close("states", rec_ref, rec, ratio)
