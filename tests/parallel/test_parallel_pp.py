"""Pipeline parallelism, real ranks (gloo, CPU, fp32): pp in {2, 4, 8}, both families, token-exact vs
the single-rank engine; chunked prefill and microbatches cut sequences across pieces; the engine-level
prefix cache resumes from KDA checkpoints that every stage wrote before rank 0 filed them."""

from __future__ import annotations

import functools
import time

import pytest

from engine.parallel.config import ParallelConfig
from tests.conftest import random_prompts
from tests.parallel import helpers
from tests.parallel.helpers import GREEDY

# budget 48: prompts are prefilled in chunks that end off page and rung boundaries, and a step's rows
# are cut into pp microbatches mid-sequence
KW = dict(max_num_batched_tokens=48, max_num_seqs=8, enable_prefix_caching=True, kda_checkpoint_pages=4)
LAYOUTS = [(m, 2) for m in ("kimi_linear", "qwen3")] + [(m, 4) for m in ("kimi_linear", "qwen3")]
LAYOUTS += [(m, 8) for m in ("deep-kimi_linear", "deep-qwen3")]


@pytest.fixture(scope="module", params=LAYOUTS, ids=[f"{m}-pp{pp}" for m, pp in LAYOUTS])
def pp_engine(request, models):
    name, pp = request.param
    eng = helpers.engine(models[name], ParallelConfig(pp=pp), **KW)
    eng.model_path = models[name]
    yield eng
    eng.close()


def test_greedy_tokens_match_single_rank(pp_engine):
    prompts = tuple(tuple(p) for p in random_prompts(5, [5, 37, 64, 90, 130], seed=31))
    want = helpers.reference(pp_engine.model_path, prompts, GREEDY, **KW)
    assert helpers.tokens(pp_engine.generate([list(p) for p in prompts], GREEDY)) == want
    assert pp_engine.pages.num_used == 0


def test_prefix_hits_resume_from_stage_checkpoints(pp_engine):
    """Prompts sharing 140 tokens: the later ones resume from the 128-token rung (KDA state forked on every
    stage from the checkpoint it wrote) and still produce the single-rank tokens. The 129-token prompt's
    first step is one token (decode-shaped): the fork still lands before its kernels, on every stage."""
    shared = random_prompts(1, [140], seed=32)[0]
    prompts = tuple(tuple(shared + tail) for tail in random_prompts(3, [3, 20, 41], seed=33))
    prompts += (tuple(shared[:129]),)
    want = helpers.reference(pp_engine.model_path, prompts, GREEDY, **KW)
    first = pp_engine.generate([list(prompts[0])], GREEDY)
    before = pp_engine.prefix_cache.resume_tokens
    rest = pp_engine.generate([list(p) for p in prompts[1:]], GREEDY)
    assert helpers.tokens(first + rest) == want
    assert pp_engine.prefix_cache.resume_tokens - before >= 3 * 128


def test_checkpoints_are_filed_after_every_stage_wrote_them(pp_engine):
    """A chunk that writes a rung checkpoint but does not sample gives rank 0 nothing to wait for but the
    'step done' marker; with the last stage slowed down, the filing must still come after its write."""
    if pp_engine.slots is None:
        pytest.skip("no KDA layers")
    filed: list[tuple[float, list[int]]] = []
    pp_engine.filing_hooks.append(lambda _pages, ckpts: filed.append((time.monotonic(), [s for _, s in ckpts])))
    pp_engine.collective_call(functools.partial(helpers.install_checkpoint_recorder, delay_s=0.2))
    try:
        prompt = random_prompts(1, [150], seed=34)[0]  # rung 64 in a non-sampling chunk, rung 128 in another
        pp_engine.generate([prompt], GREEDY)
        writes = pp_engine.collective_call(helpers.checkpoint_writes)
    finally:
        pp_engine.filing_hooks.pop()
        pp_engine.collective_call(helpers.clear_layer_hooks)
    filed_slots = [(t, s) for t, slots in filed for s in slots]
    assert len(filed_slots) == 2, filed
    for t_filed, slot in filed_slots:
        for rank, per_rank in enumerate(writes):
            t_written = [t for t, slots in per_rank if slot in slots]
            assert t_written and max(t_written) < t_filed, f"rank {rank}: slot {slot} filed ahead of its state"
