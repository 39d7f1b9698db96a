"""Piecewise prefill graphs captured and replayed on the GPU (engine/prefill_graph): the replayed pieces against
the same padded forward run eagerly (same kernels on the same shapes), and against the normal eager path.
The host runs the padded forward eagerly only (tests/test_prefill_graphs.py)."""

from __future__ import annotations

import pytest
import torch

from engine.sampling_params import SamplingParams
from tests.conftest import make_engine, random_prompts
from tests.kernels.helpers import needs_cuda

pytestmark = [pytest.mark.usefixtures("fla_unblocked"), needs_cuda]

PROMPTS = random_prompts(4, [70, 700, 9, 300], seed=4)  # 700 > 512: a chunked prompt; mixed steps follow
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _run(model_dir, hooks: bool, capture: bool | None = None, **kw) -> tuple[list, list, list, object]:
    eng = make_engine(
        model_dir, device="cuda", dtype="float32", max_num_batched_tokens=512, kv_cache_memory_bytes=64 << 20, **kw
    )
    if capture is not None:
        eng.runner.prefill_graphs.capture = capture
    calls: list[tuple] = []
    if hooks:
        eng.model.layer_hooks.append(lambda layer, b: calls.append((layer, b.num_tokens, tuple(b.request_ids))))
    logits: list[torch.Tensor] = []
    sample = eng.sampler.sample
    eng.sampler.sample = lambda lg, reqs: logits.append(lg.float().cpu().clone()) or sample(lg, reqs)
    tokens = [o.output_token_ids for o in eng.generate(PROMPTS, PARAMS)]
    return tokens, logits, calls, eng


@pytest.mark.parametrize("hooks", [False, True], ids=["decode_graphs", "hooked"])
@pytest.mark.parametrize("arch", ["kimi_linear", "qwen3"])
def test_replayed_pieces_equal_the_padded_eager_forward(tiny_models, arch, hooks):
    """Same kernels, same shapes: the replay must give the eager padded forward's logits. With a layer hook the
    decode graphs refuse every step, so decode steps replay pieces too (bucket 16), hooks between them."""
    eager = _run(tiny_models[arch], hooks, cuda_graphs=True, capture=False)
    graphs = _run(tiny_models[arch], hooks, cuda_graphs=True)
    stats_eager = eager[3].runner.prefill_graphs.stats()
    stats = graphs[3].runner.prefill_graphs.stats()
    assert stats_eager["graph_steps"] == 0 and stats_eager["eager_padded_steps"] >= 3, stats_eager
    assert stats["graph_steps"] == stats_eager["eager_padded_steps"] and stats["captures"] >= 2, stats
    assert graphs[0] == eager[0]
    assert graphs[2] == eager[2]  # hooks: same layers, same real batches, same order
    assert len(graphs[1]) == len(eager[1])
    for have, want in zip(graphs[1], eager[1], strict=True):
        torch.testing.assert_close(have, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["kimi_linear", "qwen3"])
def test_replayed_pieces_match_the_eager_path(tiny_models, arch):
    """Against the unpadded eager step: GEMMs at the bucket's row count may round differently (fp32, TF32
    off in torch's matmuls), tokens equal."""
    plain = _run(tiny_models[arch], False)
    graphs = _run(tiny_models[arch], False, cuda_graphs=True)
    assert graphs[3].runner.prefill_graphs.stats()["graph_steps"] >= 2
    assert graphs[0] == plain[0]
    for have, want in zip(graphs[1], plain[1], strict=True):
        torch.testing.assert_close(have, want, atol=2e-3, rtol=0)
