"""engine/backends/gpu.py vs the reference backends (engine/backends/torch_ref.py), and select_backends.

Without CUDA the GPU backends run their Triton kernels under the interpreter and take a reference
``chunk_fn`` for KDA prefill (fla's chunk_kda needs CUDA); with CUDA they run as in production.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from engine.backends import Backends, select_backends
from engine.backends.base import MLADims
from engine.backends.gpu import GPUAttentionBackend, GPUKDABackend, GPUMoEBackend
from engine.backends.torch_ref import TorchAttentionBackend, TorchKDABackend, TorchMoEBackend
from engine.forward_batch import ForwardBatch, kv_write_fields
from engine.sampling_params import SamplingParams
from kernels.kda.naive import kda_gate, naive_chunk_kda_varlen
from tests.conftest import make_engine, random_prompts
from tests.kernels.helpers import DEVICE, ON_CUDA, assert_close, tol

pytestmark = pytest.mark.usefixtures("fla_unblocked")


reference_chunk_fn = naive_chunk_kda_varlen  # chunk_kda_varlen's contract on the CPU


def gpu_backends() -> Backends:
    chunk_fn = None if ON_CUDA else reference_chunk_fn
    return Backends(GPUAttentionBackend(), GPUKDABackend(chunk_fn=chunk_fn), GPUMoEBackend())


def make_batch(q_lens, ctx_lens, page_size, num_pages, has_init=None, checkpoints=None, seed=0) -> ForwardBatch:
    """A ForwardBatch as ModelRunner builds it: shuffled pages, slots 2i+1, positions at the context end."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    qsl, tables, slot_mapping, positions, used = [0], [], [], [], 0
    for ql, ctx in zip(q_lens, ctx_lens, strict=True):
        qsl.append(qsl[-1] + ql)
        pages = perm[used : used + -(-ctx // page_size)]
        used += len(pages)
        tables.append(torch.tensor(pages, dtype=torch.int64, device=DEVICE))
        positions.extend(range(ctx - ql, ctx))
        slot_mapping.extend(pages[p // page_size] * page_size + p % page_size for p in range(ctx - ql, ctx))
    n = len(q_lens)
    return ForwardBatch(
        input_ids=torch.zeros(qsl[-1], dtype=torch.int64, device=DEVICE),
        positions=torch.tensor(positions, device=DEVICE),
        query_start_loc=qsl,
        context_lens=list(ctx_lens),
        block_tables=tables,
        slot_mapping=torch.tensor(slot_mapping, device=DEVICE),
        state_slots=[2 * i + 1 for i in range(n)],
        has_initial_state=list(has_init)
        if has_init is not None
        else [c > q for q, c in zip(q_lens, ctx_lens, strict=True)],
        logits_indices=torch.tensor([e - 1 for e in qsl[1:]], device=DEVICE),
        checkpoints=list(checkpoints) if checkpoints is not None else [() for _ in range(n)],
    )


MIXED = ([1, 19, 1, 40], [33, 19, 70, 90])  # decode, first chunk, decode, chunk over a prefix


def test_attention_gqa_and_mla_match_reference():
    page_size, num_pages = 16, 24
    batch = make_batch(*MIXED, page_size, num_pages)
    gpu, ref = GPUAttentionBackend(mla_expand_min_q_len=16), TorchAttentionBackend()
    torch.manual_seed(0)
    t = batch.num_tokens
    for layer in range(2):  # the second layer reuses the step's metadata
        kv = torch.randn(num_pages, page_size, 2, 2, 32, device=DEVICE)
        q = torch.randn(t, 4, 32, device=DEVICE)
        assert_close(f"gqa layer {layer}", ref.gqa(q, kv, batch, 0.17), gpu.gqa(q, kv, batch, 0.17), tol(torch.float32))
        dims = MLADims(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
        lat = torch.randn(num_pages, page_size, 40, device=DEVICE)
        kv_b = torch.randn(2 * 32, 32, device=DEVICE) * 0.2
        qm = torch.randn(t, 2, 24, device=DEVICE)
        ref_o, gpu_o = ref.mla(qm, lat, batch, kv_b, dims, 0.2), gpu.mla(qm, lat, batch, kv_b, dims, 0.2)
        assert_close(f"mla layer {layer}", ref_o, gpu_o, tol(torch.float32))
    other = make_batch([1, 1], [5, 17], page_size, num_pages, seed=1)  # a new step: new metadata
    q = torch.randn(2, 4, 32, device=DEVICE)
    assert_close("gqa next step", ref.gqa(q, kv, other, 0.17), gpu.gqa(q, kv, other, 0.17), tol(torch.float32))


def test_write_kv_skips_cached_rows():
    batch = make_batch([3, 2], [3, 9], 4, 8)
    batch.slot_mapping[1] = -1
    entries = torch.randn(5, 2, 2, 8, device=DEVICE)
    mine, theirs = torch.zeros(8, 4, 2, 2, 8, device=DEVICE), torch.zeros(8, 4, 2, 2, 8, device=DEVICE)
    GPUAttentionBackend().write_kv(mine, batch, entries)
    TorchAttentionBackend().write_kv(theirs, batch, entries)
    assert torch.equal(mine, theirs)


def test_write_kv_takes_the_builders_host_rows():
    """The rows to write come from the batch builder's host lists when it sets them (no device look)."""
    assert kv_write_fields([4, 5, 6], torch.device("cpu")) == {"all_kv_written": True}
    assert kv_write_fields([4, -1, 6, -1], torch.device("cpu"))["kv_write_rows"].tolist() == [0, 2]
    batch = make_batch([3, 2], [3, 9], 4, 8)
    batch.slot_mapping[1] = -1
    entries = torch.randn(5, 2, 2, 8, device=DEVICE)
    theirs = torch.zeros(8, 4, 2, 2, 8, device=DEVICE)
    TorchAttentionBackend().write_kv(theirs, batch, entries)
    exact = dataclasses.replace(batch, **kv_write_fields(batch.slot_mapping.cpu(), torch.device(DEVICE)))
    mine = torch.zeros_like(theirs)
    GPUAttentionBackend().write_kv(mine, exact, entries)
    assert torch.equal(mine, theirs)
    # the field is what decides: naming fewer rows writes fewer
    fewer = dataclasses.replace(batch, kv_write_rows=torch.tensor([0], device=DEVICE))
    mine.zero_()
    GPUAttentionBackend().write_kv(mine, fewer, entries)
    assert int((mine.view(32, -1) != 0).any(dim=1).sum()) == 1  # one KV row, of five


def _kda_inputs(t, h, kd, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(t, h, kd, generator=gen).to(DEVICE) for _ in range(3))
    g = kda_gate(torch.randn(t, h * kd, generator=gen), torch.zeros(h), torch.zeros(h * kd), kd).to(DEVICE)
    beta = torch.rand(t, h, generator=gen).to(DEVICE)
    return q, k, v, g, beta


KDA_SCENARIOS = {
    "decode": dict(q_lens=[1, 1, 1], ctx=[5, 9, 2], has_init=None, cks=None),
    "first_token": dict(q_lens=[1, 1], ctx=[1, 7], has_init=[False, True], cks=None),
    "mixed": dict(q_lens=MIXED[0], ctx=MIXED[1], has_init=None, cks=None),
    # rungs every 64 tokens: misaligned to the chunk start (cut), aligned after it (chunk-boundary state),
    # at a chunk's end, and on a decode token
    "checkpoints": dict(
        q_lens=[150, 1, 64, 7],
        ctx=[170, 128, 128, 7],
        has_init=None,
        cks=[((64, 20), (128, 21)), ((128, 22),), ((128, 23),), ()],
    ),
    "exact_checkpoints": dict(
        q_lens=[150, 1], ctx=[170, 128], has_init=None, cks=[((64, 20), (128, 21)), ((128, 22),)]
    ),
}


@pytest.mark.parametrize("scenario", list(KDA_SCENARIOS))
def test_kda_matches_reference(scenario):
    sc = KDA_SCENARIOS[scenario]
    batch = make_batch(sc["q_lens"], sc["ctx"], 16, 64, has_init=sc["has_init"], checkpoints=sc["cks"])
    h, kd, w, slots = 2, 16, 4, 24
    torch.manual_seed(1)
    conv = torch.randn(slots, 3 * h * kd, w - 1, device=DEVICE)
    rec = torch.randn(slots, h, kd, kd, device=DEVICE) * 0.1
    weight = torch.randn(3 * h * kd, w, device=DEVICE)
    x = torch.randn(batch.num_tokens, 3 * h * kd, device=DEVICE)
    chunk_fn = None if ON_CUDA else reference_chunk_fn
    gpu = GPUKDABackend(chunk_fn=chunk_fn, exact_checkpoints=scenario == "exact_checkpoints")
    ref = TorchKDABackend()
    conv_ref, rec_ref = conv.clone(), rec.clone()
    for layer in range(2):  # the second layer reuses the step's slot bookkeeping
        y_ref = ref.short_conv(x, conv_ref, weight, batch)
        y = gpu.short_conv(x, conv, weight, batch)
        assert_close(f"conv y, layer {layer}", y_ref, y, tol(torch.float32))
        assert_close(f"conv state, layer {layer}", conv_ref, conv, 1e-6)
        q, k, v, g, beta = _kda_inputs(batch.num_tokens, h, kd, seed=layer)
        o_ref = ref.recurrence(q, k, v, g, beta, rec_ref, batch)
        o = gpu.recurrence(q, k, v, g, beta, rec, batch)
        ratio = 1e-5 if not ON_CUDA else 5e-3  # fla's chunk kernels use TF32 dots on the GPU
        assert o.dtype == torch.float32
        assert_close(f"kda o, layer {layer}", o_ref, o, ratio)
        assert_close(f"kda state, layer {layer}", rec_ref, rec, ratio)


@pytest.mark.parametrize("scenario", ["decode", "mixed", "checkpoints"])
def test_short_conv_qkv_gives_contiguous_planes_of_the_reference(scenario):
    """The model's q | k | v conv: the reference's output split in three, as three contiguous tensors (fla's
    KDA kernels would copy column views), the windows and rung checkpoints as the reference writes them."""
    sc = KDA_SCENARIOS[scenario]
    batch = make_batch(sc["q_lens"], sc["ctx"], 16, 64, has_init=sc["has_init"], checkpoints=sc["cks"])
    torch.manual_seed(3)
    c, w = 3 * 2 * 16, 4
    conv = torch.randn(24, c, w - 1, device=DEVICE)
    weight = torch.randn(c, w, device=DEVICE)
    x = torch.randn(batch.num_tokens, c + 8, device=DEVICE)[:, 4 : 4 + c]  # the projection's column view
    conv_ref = conv.clone()
    ref = TorchKDABackend().short_conv(x, conv_ref, weight, batch).chunk(3, dim=-1)
    out = GPUKDABackend(chunk_fn=None if ON_CUDA else reference_chunk_fn).short_conv_qkv(x, conv, weight, batch)
    for name, r, o in zip("qkv", ref, out, strict=True):
        assert o.is_contiguous(), f"{name} is not contiguous"
        assert_close(f"conv {name}", r, o, tol(torch.float32))
    assert_close("conv state", conv_ref, conv, 1e-6)


@pytest.mark.parametrize("path", ["grouped", "decode kernels", "fp32 on CUDA", "decode kernels failing"])
def test_moe_matches_reference(path, monkeypatch):
    import engine.backends.gpu_moe as gpu_mod

    launched = []
    real = gpu_mod.moe_experts_decode

    def decode(*a, **kw):
        launched.append(1)
        if path == "decode kernels failing":
            raise RuntimeError("no kernel for this GPU")
        return real(*a, **kw)

    monkeypatch.setattr(gpu_mod, "moe_experts_decode", decode)
    # fp32 on CUDA: the grouped path would read group sizes on the host, so the decode kernels run unasked
    monkeypatch.setattr(GPUMoEBackend, "_grouped_needs_host", staticmethod(lambda x: path == "fp32 on CUDA"))
    decode_kernels = path in ("decode kernels", "decode kernels failing")
    gen = torch.Generator().manual_seed(2)
    t, e, k, hd, i = 13, 8, 2, 32, 16
    logits = torch.randn(t, e, generator=gen).to(DEVICE)
    bias = (torch.randn(e, generator=gen) * 0.1).to(DEVICE)
    gpu, ref = GPUMoEBackend(decode_kernels=decode_kernels), TorchMoEBackend()
    w_ref, ids_ref = ref.route(logits, bias, k, True, 2.446)
    w, ids = gpu.route(logits, bias, k, True, 2.446)
    assert torch.equal(ids.sort(1)[0], ids_ref.sort(1)[0])
    x = torch.randn(t, hd, generator=gen).to(DEVICE)
    w1, w3 = (torch.randn(e, i, hd, generator=gen).to(DEVICE) for _ in range(2))
    w2 = torch.randn(e, hd, i, generator=gen).to(DEVICE)
    w13 = torch.cat([w1, w3], dim=1)  # packed, as CausalLM.pack_weights leaves them (the decode kernels need it)
    w1, w3 = w13[:, :i], w13[:, i:]
    want = ref.experts(x, w_ref, ids_ref, w1, w3, w2)
    assert_close("experts", want, gpu.experts(x, w, ids, w1, w3, w2, w13), tol(torch.float32))
    assert bool(launched) == (path != "grouped")  # the path under test is the one that ran
    if path == "decode kernels failing":  # fell back to the grouped path, and stays there
        assert gpu._decode_failed
        gpu.experts(x, w, ids, w1, w3, w2, w13)
        assert len(launched) == 1


@pytest.mark.parametrize("path", ["prefill kernels", "grouped", "fp32 on CUDA", "prefill kernels failing"])
def test_moe_long_steps_match_reference(path, monkeypatch):
    """Steps past the decode size (here: past 8 pairs) take kernels/moe/prefill.py unless turned off; fp32 on
    CUDA takes them unasked; a failure falls back to the grouped path for good."""
    import engine.backends.gpu_moe as gpu_mod

    launched = []
    real = gpu_mod.moe_experts_prefill

    def prefill(*a, **kw):
        launched.append(1)
        if path == "prefill kernels failing":
            raise RuntimeError("no kernel for this GPU")
        return real(*a, **kw)

    monkeypatch.setattr(gpu_mod, "moe_experts_prefill", prefill)
    monkeypatch.setattr(gpu_mod, "DECODE_MAX_PAIRS", 8)
    monkeypatch.setattr(GPUMoEBackend, "_grouped_needs_host", staticmethod(lambda x: path == "fp32 on CUDA"))
    gen = torch.Generator().manual_seed(5)
    t, e, k, hd, i = 21, 8, 2, 32, 16
    logits = torch.randn(t, e, generator=gen).to(DEVICE)
    gpu = GPUMoEBackend(prefill_kernels=path in ("prefill kernels", "prefill kernels failing"))
    ref = TorchMoEBackend()
    w, ids = ref.route(logits, None, k, True, 2.446)
    x = torch.randn(t, hd, generator=gen).to(DEVICE)
    w13 = torch.randn(e, 2 * i, hd, generator=gen).to(DEVICE)
    w1, w3 = w13[:, :i], w13[:, i:]
    w2 = torch.randn(e, hd, i, generator=gen).to(DEVICE)
    want = ref.experts(x, w, ids, w1, w3, w2)
    assert_close("experts", want, gpu.experts(x, w, ids, w1, w3, w2, w13), tol(torch.float32))
    assert bool(launched) == (path != "grouped")
    if path == "prefill kernels failing":
        assert gpu._prefill_failed
        gpu.experts(x, w, ids, w1, w3, w2, w13)
        assert len(launched) == 1


def test_moe_down_impl_is_chosen_by_env_and_refused_by_name(monkeypatch):
    """``TANDEM_MOE_DOWN_IMPL`` reaches ``moe_experts_prefill`` (here "tma": both operands through descriptors,
    run by the interpreter on this host) with the reference's outputs; an unknown name is refused at start."""
    import engine.backends.gpu_moe as gpu_mod
    import kernels.moe.prefill as prefill

    ran = []
    real = prefill.down_tma
    monkeypatch.setattr(prefill, "down_tma", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    monkeypatch.setattr(gpu_mod, "DECODE_MAX_PAIRS", 8)
    monkeypatch.setenv("TANDEM_MOE_DOWN_IMPL", "tma")
    gen = torch.Generator().manual_seed(6)
    t, e, k, hd, i = 19, 8, 2, 32, 16
    ref = TorchMoEBackend()
    w, ids = ref.route(torch.randn(t, e, generator=gen).to(DEVICE), None, k, True, 2.446)
    x = torch.randn(t, hd, generator=gen).to(DEVICE)
    w13 = torch.randn(e, 2 * i, hd, generator=gen).to(DEVICE)
    w2 = torch.randn(e, hd, i, generator=gen).to(DEVICE)
    gpu = GPUMoEBackend(prefill_kernels=True)
    assert gpu.down_impl == "tma"
    got = gpu.experts(x, w, ids, w13[:, :i], w13[:, i:], w2, w13)
    assert_close("experts, tma down", ref.experts(x, w, ids, w13[:, :i], w13[:, i:], w2), got, tol(torch.float32))
    assert ran and not gpu._prefill_failed
    monkeypatch.setenv("TANDEM_MOE_DOWN_IMPL", "cublas")
    with pytest.raises(ValueError, match="TANDEM_MOE_DOWN_IMPL"):
        GPUMoEBackend()


# ---- select_backends ------------------------------------------------------------------------------


def _kinds(b: Backends) -> tuple[type, type, type]:
    return type(b.attention), type(b.kda), type(b.moe)


def test_select_backends_cpu_is_reference(monkeypatch):
    monkeypatch.delenv("TANDEM_BACKEND", raising=False)
    assert _kinds(select_backends(torch.device("cpu"))) == (TorchAttentionBackend, TorchKDABackend, TorchMoEBackend)


def test_select_backends_cuda_is_gpu_and_env_overrides(monkeypatch):
    cuda = torch.device("cuda")  # select_backends only reads the device type: no GPU needed here
    monkeypatch.delenv("TANDEM_BACKEND", raising=False)
    assert _kinds(select_backends(cuda)) == (GPUAttentionBackend, GPUKDABackend, GPUMoEBackend)
    monkeypatch.setenv("TANDEM_BACKEND", "torch")
    assert _kinds(select_backends(cuda)) == (TorchAttentionBackend, TorchKDABackend, TorchMoEBackend)
    monkeypatch.setenv("TANDEM_BACKEND", "gpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backends(torch.device("cpu"))
    monkeypatch.setenv("TANDEM_BACKEND", "fast")
    with pytest.raises(ValueError, match="auto, torch, gpu or interpret"):
        select_backends(cuda)
    monkeypatch.setenv("TANDEM_BACKEND", "interpret")
    with pytest.raises(ValueError, match="runs on the CPU with TRITON_INTERPRET=1"):
        select_backends(cuda)


def test_select_backends_without_fla_falls_back_for_kda(monkeypatch, caplog):
    monkeypatch.delenv("TANDEM_BACKEND", raising=False)
    monkeypatch.setattr("kernels.kda.fla_adapter.fla_available", lambda: False)
    with caplog.at_level(logging.WARNING):
        b = select_backends(torch.device("cuda"))
    assert _kinds(b) == (GPUAttentionBackend, TorchKDABackend, GPUMoEBackend)
    assert "fla-core is not importable" in caplog.text


# ---- the whole engine ----------------------------------------------------------------------------


@pytest.mark.skipif(ON_CUDA, reason="CPU engine with interpreted kernels; bench/gpu_kernels_check.py covers CUDA")
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["plain", "prefix_cache"])
@pytest.mark.parametrize("arch", ["kimi_linear", "qwen3"])
def test_engine_tokens_match_reference(tiny_models, arch, prefix_caching):
    """Greedy tokens of the tiny models with the GPU backends == the reference backends, through chunked
    prefill (budget 48 tokens), mixed prefill/decode steps and, with the prefix cache, KDA rung checkpoints."""
    prompts = random_prompts(3, [70, 9, 130], seed=5)
    prompts.append(prompts[2][:100] + prompts[0][:10])  # shares 100 tokens with prompt 2: a prefix hit
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    kw = dict(max_num_batched_tokens=48, enable_prefix_caching=prefix_caching)
    ref = make_engine(tiny_models[arch], **kw)
    eng = make_engine(tiny_models[arch], **kw)
    eng.model.backends = gpu_backends()
    expected = [o.output_token_ids for o in ref.generate(prompts, params)]
    got = [o.output_token_ids for o in eng.generate(prompts, params)]
    assert got == expected


@pytest.mark.skipif(ON_CUDA, reason="CPU engine with interpreted kernels; bench/gpu_kernels_check.py covers CUDA")
def test_engine_tokens_match_reference_through_the_moe_prefill_kernels(tiny_models, monkeypatch):
    """The tiny steps stay under the decode kernels' 4,096 pairs; with the bound at 16 pairs every prefill /
    mixed step's experts run through kernels/moe/prefill.py, decode steps (4 tokens, 8 pairs) through the decode
    kernels (weights packed, as on CUDA): greedy tokens == the reference backends."""
    import engine.backends.gpu_moe as gpu_mod

    ran = []
    real = gpu_mod.moe_experts_prefill
    monkeypatch.setattr(gpu_mod, "DECODE_MAX_PAIRS", 16)
    monkeypatch.setattr(gpu_mod, "moe_experts_prefill", lambda *a, **kw: ran.append(1) or real(*a, **kw))
    monkeypatch.setenv("TANDEM_PACK_WEIGHTS", "1")  # the expert kernels take w1 | w3 packed, as on CUDA
    prompts = random_prompts(3, [70, 9, 130], seed=6)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref = make_engine(tiny_models["kimi_linear"], max_num_batched_tokens=48)
    eng = make_engine(tiny_models["kimi_linear"], max_num_batched_tokens=48)
    eng.model.backends = gpu_backends()
    expected = [o.output_token_ids for o in ref.generate(prompts, params)]
    assert [o.output_token_ids for o in eng.generate(prompts, params)] == expected
    assert ran  # the path under test ran
