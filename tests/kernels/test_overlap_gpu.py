"""Overlapped decode on the GPU (engine/overlap.py with captured graphs): the same tokens as the graph steps
taken one at a time. Here new graphs are captured between two overlapped steps (the batch shrinks, contexts
cross buckets) while the in-flight step's greedy ids wait in the static buffer the next step carries from:
the twenty-third session's first version lost them to the capture's warm-up passes (overlapped 90.7 % against
the graph mode's 96.3 % in bench.gpu_agreement). The host runs the same logic eagerly
(tests/test_async_scheduling.py), without captures."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from tests.conftest import make_engine, random_prompts
from tests.kernels.helpers import ON_CUDA

pytestmark = [
    pytest.mark.usefixtures("fla_unblocked"),
    pytest.mark.skipif(not ON_CUDA, reason="captures CUDA graphs: needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["kimi_linear", "qwen3"])
def test_overlapped_steps_equal_graph_steps_across_captures(tiny_models, arch, dtype):
    prompts = random_prompts(5, [5, 9, 12, 20, 3], seed=2)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (70, 6, 40, 15, 100)]
    runs = {}
    for overlap in (False, True):
        eng = make_engine(
            tiny_models[arch], device="cuda", dtype=dtype, max_num_seqs=8, kv_cache_memory_bytes=64 << 20,
            cuda_graphs=True, async_scheduling=overlap,
        )  # fmt: skip
        runs[overlap] = ([o.output_token_ids for o in eng.generate(prompts, params)], eng)
    eng = runs[True][1]
    stats = eng.runner.decode_graphs.stats()
    assert stats["captures"] >= 4 and stats["graph_steps"] > 50, stats  # captured, mid-run
    assert eng.overlap.counts["continued"] > 50, eng.overlap.counts
    assert runs[True][0] == runs[False][0]
