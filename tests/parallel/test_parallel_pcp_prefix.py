"""PCP with the engine-level prefix cache (its own module: one parallel engine per process at a time)."""

from __future__ import annotations

from engine.parallel.config import ParallelConfig
from tests.conftest import random_prompts
from tests.parallel import helpers
from tests.parallel.helpers import GREEDY
from tests.parallel.test_parallel_pcp import KW


def test_prefix_hits_and_rungs_under_pcp(models):
    """With the engine-level prefix cache, chunks that write rung checkpoints take the plain recurrence
    (every rank, all rows) so each rung's state exists; hits fork it on every rank. Tokens as one rank."""
    kw = dict(KW, enable_prefix_caching=True, max_num_batched_tokens=100)
    shared = random_prompts(1, [140], seed=53)[0]
    prompts = tuple(tuple(shared + t) for t in random_prompts(3, [1, 9, 30], seed=54))
    prompts += (tuple(shared[:129]),)  # resumes at 128: a one-token first step after the fork
    want = helpers.reference(models["kimi_linear"], prompts, GREEDY, **kw)
    eng = helpers.engine(models["kimi_linear"], ParallelConfig(pcp=2), **kw)
    try:
        got = helpers.tokens(eng.generate([list(prompts[0])], GREEDY))
        got += helpers.tokens(eng.generate([list(p) for p in prompts[1:]], GREEDY))
        assert got == want
        assert eng.prefix_cache.resume_tokens >= 3 * 128
    finally:
        eng.close()
