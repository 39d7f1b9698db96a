"""The GPU engines' default page (64 tokens: FlashMLA's, engine/config.GPU_PAGE_SIZE) under every parallel
layout, real ranks on the CPU: greedy tokens equal the single-rank engine's at pages of 64 and at pages of 16
(the page size must change no token), with prompts shorter than one page, one page exactly, and several pages
with a partial last one, decoding across a page boundary."""

from __future__ import annotations

import pytest

from engine.config import CPU_PAGE_SIZE, GPU_PAGE_SIZE
from engine.parallel.config import ParallelConfig
from engine.sampling_params import SamplingParams
from tests.conftest import random_prompts
from tests.parallel import helpers

KW = dict(max_num_seqs=8, max_num_batched_tokens=256, page_size=GPU_PAGE_SIZE)
LAYOUTS = [
    ParallelConfig(pcp=2),
    ParallelConfig(pp=2),
    ParallelConfig(tp=2),
    ParallelConfig(pcp=2, pp=2),
]
DECODE = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
PROMPTS = tuple(tuple(p) for p in random_prompts(4, [5, 64, 130, 250], seed=64))


@pytest.fixture(scope="module", params=LAYOUTS, ids=[p.describe() for p in LAYOUTS])
def page64_engine(request, models):
    eng = helpers.engine(models["kimi_linear"], request.param, **KW)
    yield eng
    eng.close()


def test_tokens_match_single_rank_in_pages_of_64_and_16(page64_engine, models):
    want = helpers.reference(models["kimi_linear"], PROMPTS, DECODE, **KW)
    small = helpers.reference(models["kimi_linear"], PROMPTS, DECODE, **{**KW, "page_size": CPU_PAGE_SIZE})
    assert want == small  # the page size is storage layout only
    assert page64_engine.config.page_size == GPU_PAGE_SIZE
    assert helpers.tokens(page64_engine.generate([list(p) for p in PROMPTS], DECODE)) == want
