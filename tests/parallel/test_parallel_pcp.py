"""Prefill context parallelism, real ranks: pcp in {2, 3, 4, 8} and pcp x pp, both families. Prompt
lengths that are and are not multiples of pcp (padding rows); tokens equal the single-rank engine,
prompt logits agree to 1e-4, and every rank's pages and KDA state equal the single-rank engine's."""

from __future__ import annotations

import pytest
import torch

from engine.parallel.config import ParallelConfig
from tests.conftest import random_prompts
from tests.parallel import helpers
from tests.parallel.helpers import GREEDY

KW = dict(max_num_seqs=8, max_num_batched_tokens=256)
LAYOUTS = [(m, ParallelConfig(pcp=n)) for n in (2, 3, 4, 8) for m in ("kimi_linear", "qwen3")]
LAYOUTS += [(m, ParallelConfig(pcp=2, pp=2)) for m in ("kimi_linear", "qwen3")]
LAYOUTS += [("kimi_linear", ParallelConfig(pcp=4, pp=2))]
# the LM-head setting GPU engines default to (vocab-sharded under TP): under PCP alone it must not gather the
# PCP ranks' logits as vocab shards (that doubled the vocabulary on the H200: sampled ids past the embedding)
LAYOUTS += [("qwen3", ParallelConfig(pcp=2, tp_shard_lm_head=True))]


def _layout_id(m: str, p: ParallelConfig) -> str:
    return f"{m}-{p.describe()}" + ("-shard-lm-head" if p.tp_shard_lm_head else "")


@pytest.fixture(scope="module", params=LAYOUTS, ids=[_layout_id(m, p) for m, p in LAYOUTS])
def pcp_engine(request, models):
    name, parallel = request.param
    eng = helpers.engine(models[name], parallel, **KW)
    eng.model_path = models[name]
    yield eng
    eng.close()


def test_tokens_match_single_rank(pcp_engine):
    """A mixed batch (rows striped across requests), then prompts alone: 24 rows (a multiple of every
    pcp here) and 37 (a multiple of none: padding rows on some ranks); 1 row: all but one rank pad."""
    batch = tuple(tuple(p) for p in random_prompts(6, [1, 5, 24, 37, 64, 90], seed=51))
    want = helpers.reference(pcp_engine.model_path, batch, GREEDY, **KW)
    assert helpers.tokens(pcp_engine.generate([list(p) for p in batch], GREEDY)) == want
    for k in (0, 2, 3):
        assert helpers.tokens(pcp_engine.generate([list(batch[k])], GREEDY)) == [want[k]], len(batch[k])


@pytest.mark.parametrize("length", [24, 37, 200])
def test_prompt_logits_and_caches_equal_single_rank(pcp_engine, length):
    """200 tokens: up to 4 KDA segments (one a rank, chunk-aligned) joined by the state scan."""
    prompt = random_prompts(1, [length], seed=52)[0]
    ref = helpers.engine(pcp_engine.model_path, **KW)
    n_pages = -(-length // ref.config.page_size)
    # the next allocation takes the head of each free list (no prefix cache here)
    pages, ref_pages = list(pcp_engine.pages._free)[:n_pages], list(ref.pages._free)[:n_pages]
    slot = pcp_engine.slots._free[0] if pcp_engine.slots is not None else 0
    ref_slot = ref.slots._free[0] if ref.slots is not None else 0
    want, got = ref.prompt_logits(prompt), pcp_engine.prompt_logits(prompt)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)

    want_cache = helpers.caches_of(ref.cache, ref_pages, ref_slot, length)
    for rank, c in enumerate(pcp_engine.collective_call(helpers.request_caches(pages, slot, length))):
        for kind, layers in c.items():
            for layer, t in layers.items():
                where = f"rank {rank} {kind} layer {layer}"
                torch.testing.assert_close(t, want_cache[kind][layer], rtol=0, atol=2e-5, msg=where)


def test_one_ulp_apart_ranks_emit_the_same_ids(pcp_engine):
    p = pcp_engine.parallel
    for nudge in (p.world_size - 1, p.rank_of(p.pp - 1, 0)):
        helpers.check_sampled_ids_agree(pcp_engine, nudge)
