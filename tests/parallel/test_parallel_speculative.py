"""Speculative decoding on a parallel decode engine (gloo, CPU, fp32): greedy outputs equal the
single-rank, non-speculative engine's token for token, with n-gram and aux-tap drafters and per-request
k in {1, 3, 7} mixed in one batch; every rank learns the same tokens and accepted counts (stages that do
not sample follow the rollback); taps resident on later stages reach rank 0's drafter. A PCP x PP
producer captures the aux taps a consumer's drafter reads, equal to one process's."""

from __future__ import annotations

import pytest
import torch

from engine.config import SpeculativeConfig
from engine.parallel.config import ParallelConfig
from engine.sampling_params import SamplingParams
from engine.spec.aux_tap import make_tiny_drafter
from tests.conftest import make_engine, random_prompts
from tests.parallel import helpers
from tests.test_speculative import OracleDrafter

MAX = 24
KW = dict(max_num_batched_tokens=64, max_num_seqs=8)
TAPS = {"kimi_linear": (-1, 1, 3), "qwen3": (-1, 2, 3)}  # later stages own layers 2 and 3 under pp=2


def _prompts() -> list[list[int]]:
    rep = random_prompts(1, [12], seed=50)[0]
    return [rep * 4, *random_prompts(3, [5, 33, 70], seed=51)]  # (single-process n-gram drafts hit on these)


def _params() -> list[SamplingParams]:
    ks = [3, 1, 3, 7]  # per-request k, all in one batch
    return [SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True, num_speculative_tokens=k) for k in ks]


GREEDY = SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True)

CASES = [
    ("kimi_linear", ParallelConfig(pp=2), "ngram"),
    ("kimi_linear", ParallelConfig(pp=2), "aux_tap"),
    ("qwen3", ParallelConfig(pp=2), "ngram"),
    ("qwen3", ParallelConfig(pp=2), "aux_tap"),
    ("kimi_linear", ParallelConfig(tp=2), "aux_tap"),
    ("qwen3", ParallelConfig(tp=2, pp=2), "aux_tap"),
]


@pytest.fixture(scope="module")
def drafters(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafters")
    return {a: make_tiny_drafter(root / a, models[a], aux_layer_ids=TAPS[a]) for a in TAPS}


@pytest.mark.parametrize(("arch", "layout", "method"), CASES, ids=[f"{a}-{p.describe()}-{m}" for a, p, m in CASES])
def test_speculative_greedy_is_lossless(models, drafters, arch, layout, method):
    prompts = tuple(tuple(p) for p in _prompts())
    want = helpers.reference(models[arch], prompts, GREEDY, **KW)
    spec = SpeculativeConfig(method, 7, str(drafters[arch]) if method == "aux_tap" else None)
    eng = helpers.engine(models[arch], layout, speculative=spec, **KW)
    try:
        got = eng.generate([list(p) for p in prompts], _params())
        assert [o.output_token_ids for o in got] == want
        assert sum(o.num_verify_steps for o in got) > 0
        if method == "ngram":
            assert sum(o.num_accepted for o in got) > 0, "n-gram drafts should sometimes be right"
        emitted = eng.collective_call(helpers.emitted)
        accepted = eng.collective_call(helpers.accepted)
        assert all(e == emitted[0] for e in emitted), "ranks emitted different tokens"
        assert all(a == accepted[0] for a in accepted), "ranks learned different accepted counts"
        assert sum(accepted[0]) == sum(o.num_accepted for o in got)
        assert eng.pages.num_used == 0 and (eng.slots is None or eng.slots.num_used == 0)
    finally:
        eng.close()


def test_oracle_drafter_full_acceptance_under_pp(models):
    """Every draft accepted: stages > 0 (no sampler there) keep every position's state and pages."""
    prompts = tuple(tuple(p) for p in _prompts())
    want = helpers.reference(models["kimi_linear"], prompts, GREEDY, **KW)
    eng = helpers.engine(models["kimi_linear"], ParallelConfig(pp=2), speculative=SpeculativeConfig("ngram", 3), **KW)
    try:
        eng.drafter = OracleDrafter(prompts, want)
        outs = eng.generate([list(p) for p in prompts], GREEDY)
        assert helpers.tokens(outs) == want
        for o in outs:
            assert o.acceptance_rate == 1.0 and o.mean_accepted_length > 3
        accepted = eng.collective_call(helpers.accepted)
        assert all(a == accepted[0] for a in accepted)
        assert sum(accepted[0]) == sum(o.num_accepted for o in outs) > 0
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ["kimi_linear", "qwen3"])
def test_pcp_pp_producer_captures_the_consumers_taps(models, arch):
    """A prefill worker (pcp=2 x pp=2) asked for taps -1, 1 and 3: rows striped over PCP ranks and
    layers on both stages, gathered on rank 0 equal to one process's capture at the prompt's last row."""
    taps = (-1, 1, 3)
    prompts = random_prompts(3, [7, 30, 61], seed=72)  # 7 and 61 are not multiples of pcp
    one = make_engine(models[arch], **KW)
    one.add_aux_layers(taps)
    want = one.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    eng = helpers.engine(models[arch], ParallelConfig(pcp=2, pp=2), **KW)
    try:
        eng.add_aux_layers(taps)
        got = eng.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    finally:
        eng.close()
    for g, w in zip(got, want, strict=True):
        assert g.aux_layer_ids == w.aux_layer_ids == taps
        torch.testing.assert_close(g.aux_hidden, w.aux_hidden, rtol=1e-5, atol=1e-5)
