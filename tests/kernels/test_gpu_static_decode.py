"""The GPU backends' static decode path (ForwardBatch.decode_meta: engine/backends/gpu_static.py) through a
whole engine: on the host the Triton / fla kernels run under the interpreter and DecodeGraphs runs its padded
static steps eagerly, so this checks the graph-safe metadata (static attention work lists, the bucket's key
split, slot tensors, the scratch page / slot of padding rows) against the reference backends' tokens.
"""

from __future__ import annotations

import pytest

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
