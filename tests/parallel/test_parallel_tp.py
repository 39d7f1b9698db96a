"""Tensor parallelism (decode), real ranks: tp in {2, 4} (and tp=2 x pp=2), both families, greedy and
seeded sampling token-exact vs the single-rank engine; sampled ids agree on every rank even when ranks'
logits differ by one ULP."""

from __future__ import annotations

import pytest

from engine.parallel.config import ParallelConfig
from engine.sampling_params import SamplingParams
from tests.conftest import random_prompts
from tests.parallel import helpers

KW = dict(max_num_seqs=8)
LAYOUTS = [
    ("kimi_linear", ParallelConfig(tp=2)),
    ("qwen3", ParallelConfig(tp=2)),
    ("deep-kimi_linear", ParallelConfig(tp=4)),
    ("deep-qwen3", ParallelConfig(tp=4, tp_shard_lm_head=True)),  # KV heads replicated; vocab-sharded head
    ("deep-kimi_linear", ParallelConfig(tp=2, pp=2)),
    ("tied-qwen3", ParallelConfig(tp=2)),  # the head stays tied to the (replicated) embedding
    ("tied-qwen3", ParallelConfig(tp=2, pp=2)),  # the last stage loads the embedding as its head
]
DECODE = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=77, ignore_eos=True)


@pytest.fixture(scope="module", params=LAYOUTS, ids=[f"{m}-{p.describe()}" for m, p in LAYOUTS])
def tp_engine(request, models):
    name, parallel = request.param
    eng = helpers.engine(models[name], parallel, **KW)
    eng.model_path = models[name]
    yield eng
    eng.close()


@pytest.mark.parametrize("params", [DECODE, SEEDED], ids=["greedy", "seeded"])
def test_tokens_match_single_rank(tp_engine, params):
    prompts = tuple(tuple(p) for p in random_prompts(4, [3, 17, 40, 66], seed=41))
    want = helpers.reference(tp_engine.model_path, prompts, params, **KW)
    assert helpers.tokens(tp_engine.generate([list(p) for p in prompts], params)) == want


def test_one_ulp_apart_ranks_emit_the_same_ids(tp_engine):
    p = tp_engine.parallel
    for nudge in (p.world_size - 1, p.rank_of(p.pp - 1, 0)):  # a rank whose logits are unused; the sampled one
        helpers.check_sampled_ids_agree(tp_engine, nudge)
