"""The GPU backends' static decode path (ForwardBatch.decode_meta: engine/backends/gpu_static.py) through a
whole engine: on the host the Triton / fla kernels run under the interpreter and DecodeGraphs runs its padded
static steps eagerly, so this checks the graph-safe metadata (static attention work lists, the bucket's key
split, slot tensors, the scratch page / slot of padding rows) against the reference backends' tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.sampling_params import SamplingParams
from tests.conftest import make_engine, random_prompts
from tests.kernels.helpers import ON_CUDA
from tests.kernels.test_gpu_backend import gpu_backends

pytestmark = pytest.mark.usefixtures("fla_unblocked")


@pytest.mark.skipif(ON_CUDA, reason="CPU engine with interpreted kernels; bench/gpu_mid.py covers CUDA graphs")
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["plain", "prefix_cache"])
@pytest.mark.parametrize("arch", ["kimi_linear", "qwen3"])
def test_static_decode_with_gpu_backends_matches_reference(tiny_models, arch, prefix_caching):
    prompts = random_prompts(3, [70, 9, 300], seed=3)  # 3 requests: padded to 4 rows; 300 tokens: a 512 bucket
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    kw = dict(max_num_batched_tokens=512, enable_prefix_caching=prefix_caching, kda_checkpoint_pages=4)
    ref = make_engine(tiny_models[arch], **kw)
    eng = make_engine(tiny_models[arch], cuda_graphs=True, **kw)
    eng.model.backends = gpu_backends()
    expected = [o.output_token_ids for o in ref.generate(prompts, params)]
    got = [o.output_token_ids for o in eng.generate(prompts, params)]
    stats = eng.runner.decode_graphs.stats()
    assert stats["eager_static_steps"] >= 6 and stats["padded_rows"] > 0, stats
    assert got == expected


@pytest.mark.skipif(ON_CUDA, reason="CPU engine with interpreted kernels; bench/gpu_mid.py covers CUDA graphs")
@pytest.mark.parametrize("arch", ["kimi_linear", "qwen3"])
def test_split_keys_and_overlap_as_on_the_gpu(tiny_models, arch, monkeypatch):
    """With an H200's 132 SMs the attention kernel splits the keys of a small decode batch, and the static
    step splits by the context bucket while the normal path splits by the exact length: the two paths run
    different split / merge launches. Overlapped decode (carried ids) and packed weights (as the engine packs
    them on CUDA) on top; tokens and decode logits as the reference's."""
    import kernels.paged_attention.mla_decode as mla_decode
    import kernels.paged_attention.triton as paged

    splits: list[int] = []  # decode launches of both kernels: the general one (GQA) and MLA's all-heads one
    for mod, name in ((paged, "choose_splits"), (mla_decode, "mla_decode_splits")):
        monkeypatch.setattr(mod, "_num_sms", lambda device: 132)
        choose = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=choose, **k: splits.append(_f(*a, **k)) or splits[-1])
    prompts = random_prompts(2, [300, 150], seed=5)  # a 512-token bucket: 2 key splits, 1 at the exact length
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref = make_engine(tiny_models[arch], max_num_batched_tokens=512)
    eng = make_engine(tiny_models[arch], max_num_batched_tokens=512, cuda_graphs=True, async_scheduling=True)
    eng.model.backends = gpu_backends()
    eng.model.pack_weights()  # as the engine does on CUDA
    ref_logits, got_logits = _record_decode_logits(ref), _record_decode_logits(eng)
    expected = [o.output_token_ids for o in ref.generate(prompts, params)]
    got = [o.output_token_ids for o in eng.generate(prompts, params)]
    assert eng.overlap.counts["continued"] >= 3, eng.overlap.counts
    assert max(splits) >= 2, splits  # the split / merge launches really ran
    assert got == expected
    assert len(ref_logits) == params.max_tokens - 1 <= len(got_logits)  # + the dropped step past the end
    for want, have in zip(ref_logits, got_logits, strict=False):
        torch.testing.assert_close(have, want, atol=1e-4, rtol=0)


def _record_decode_logits(eng) -> list:
    """Logits of every pure-decode step (the static step's on the graph engine), cloned as they come."""
    seen: list = []
    target = eng.runner.decode_graphs if eng.runner.decode_graphs is not None else eng.runner
    fn = target.run if eng.runner.decode_graphs is not None else target.execute

    def recording(chunks, *a, **k):
        logits = fn(chunks, *a, **k)
        if all(c.num_tokens == 1 for c in chunks):
            seen.append(logits.clone())
        return logits

    if eng.runner.decode_graphs is not None:
        target.run = recording
    else:
        target.execute = recording
    return seen


@pytest.mark.skipif(ON_CUDA, reason="CPU engine with interpreted kernels; bench/gpu_agreement.py covers the GPU")
def test_one_row_steps_through_the_skinny_gemm(tiny_models, monkeypatch):
    """Prompts decoded alone, so every decode step is one row: the dense projections take kernels/gemv, KDA's
    output norm runs inside its projection (kernels/gemv/gated_norm.py), each layer's input norm inside its first
    projection (kernels/gemv/add_norm.py) and the MoE experts take their pair rows (no align). Tokens and logits as
    the reference's."""
    import engine.backends.gpu_moe as gpu_backend
    from engine.backends.dense import TritonDense

    experts_decode, layouts = gpu_backend.moe_experts_decode, []  # (rows, pair rows?) of each MoE experts launch
    monkeypatch.setattr(
        gpu_backend,
        "moe_experts_decode",
        lambda x, al, *a, **k: layouts.append((x.shape[0], al is None)) or experts_decode(x, al, *a, **k),
    )

    # every input norm through its first projection: none run by the MoE combine before it (test_moe_combine_norm.py)
    monkeypatch.setenv("TANDEM_MOE_COMBINE_NORM", "0")
    calls = {"gemv": 0, "gated": 0, "add_norm": 0}
    # add_norm: off by default (slower on the H200), kept correct; the norm after o_proj: test_gemv_norm_after.py
    dense = TritonDense(add_norm=True, norm_after=False)
    gemv, gated, add_norm = dense._gemv, dense._gated_norm_gemv, dense._add_norm_gemv
    dense._gemv = lambda *a, **k: calls.__setitem__("gemv", calls["gemv"] + 1) or gemv(*a, **k)
    dense._gated_norm_gemv = lambda *a, **k: calls.__setitem__("gated", calls["gated"] + 1) or gated(*a, **k)
    dense._add_norm_gemv = lambda *a, **k: calls.__setitem__("add_norm", calls["add_norm"] + 1) or add_norm(*a, **k)
    prompts = random_prompts(2, [40, 11], seed=9)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    ref = make_engine(tiny_models["kimi_linear"], max_num_batched_tokens=512)
    eng = make_engine(tiny_models["kimi_linear"], max_num_batched_tokens=512, cuda_graphs=True)
    eng.model.backends = dataclasses.replace(gpu_backends(), dense=dense)
    eng.model.pack_weights()
    ref_logits, got_logits = _record_decode_logits(ref), _record_decode_logits(eng)
    for p in prompts:
        assert eng.generate([p], params)[0].output_token_ids == ref.generate([p], params)[0].output_token_ids
    assert calls["gated"] > 0 and calls["gemv"] > 0 and calls["add_norm"] > calls["gated"], calls
    assert (1, True) in layouts and (1, False) not in layouts, layouts  # one row: always the pair rows
    assert len(got_logits) >= len(ref_logits) == 2 * (params.max_tokens - 1)
    for want, have in zip(ref_logits, got_logits, strict=False):
        torch.testing.assert_close(have, want, atol=1e-4, rtol=0)
