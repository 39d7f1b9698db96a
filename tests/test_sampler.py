"""Sampling: seeds, greedy, top-k / top-p filtering and returned logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.request import Request
from engine.sampler import Sampler, filtered_probs
from engine.sampling_params import SamplingParams
from tests.conftest import make_engine, random_prompts

PROMPTS = random_prompts(4, [10, 23, 5, 41], seed=31)


def _sp(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 12)
    kw.setdefault("ignore_eos", True)
    return SamplingParams(**kw)


# ---- engine level ------------------------------------------------------------------------------
def test_same_seed_same_tokens_across_batches(model_dir):
    target = _sp(temperature=1.0, seed=7)
    alone = make_engine(model_dir).generate([PROMPTS[0]], target)[0].output_token_ids
    again = make_engine(model_dir).generate([PROMPTS[0]], target)[0].output_token_ids
    assert alone == again
    # in a batch, behind unseeded sampling requests that draw from the shared generator first,
    # with a different step budget (chunked prefill) and a different engine seed
    eng = make_engine(model_dir, max_num_batched_tokens=9, seed=123)
    outs = eng.generate(
        [PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[3]],
        [_sp(temperature=1.0), _sp(temperature=0.5, top_k=5), target, _sp(temperature=1.3, seed=7)],
    )
    assert outs[2].output_token_ids == alone
    greedy = make_engine(model_dir).generate([PROMPTS[0]], _sp(temperature=0))[0].output_token_ids
    assert alone != greedy, "temperature 1 sampled exactly the greedy tokens: test is vacuous"


def test_different_seeds_differ(model_dir):
    eng = make_engine(model_dir)
    outs = [eng.generate([PROMPTS[0]], _sp(temperature=1.0, seed=s))[0].output_token_ids for s in range(4)]
    assert len({tuple(o) for o in outs}) == 4, outs


def test_engine_seed_for_unseeded_requests(model_dir):
    def run(seed: int) -> list[list[int]]:
        eng = make_engine(model_dir, seed=seed)
        return [o.output_token_ids for o in eng.generate(PROMPTS[:2], _sp(temperature=1.0))]

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_greedy_is_argmax_of_model_logits(model_dir):
    eng = make_engine(model_dir)
    for prompt in PROMPTS[:2]:
        out = eng.generate([prompt], _sp(temperature=0))[0].output_token_ids
        logits = eng.prompt_logits(prompt + out[:-1])[len(prompt) - 1 :]
        assert logits.argmax(-1).tolist() == out


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0, top_k=1),
        dict(temperature=2.0, top_k=1, seed=5),
        dict(temperature=1.0, top_p=1e-6, seed=5),
        dict(temperature=1e-4, seed=9),
    ],
    ids=["top_k=1", "top_k=1-seeded", "top_p~0", "temperature~0"],
)
def test_degenerate_sampling_equals_greedy(model_dir, params):
    eng = make_engine(model_dir)
    greedy = [o.output_token_ids for o in eng.generate(PROMPTS, _sp(temperature=0))]
    assert [o.output_token_ids for o in eng.generate(PROMPTS, _sp(**params))] == greedy


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=1.0, seed=3)])
def test_logprobs_match_model_logits(model_dir, params):
    eng = make_engine(model_dir)
    prompt = PROMPTS[1]
    out = eng.generate([prompt], _sp(logprobs=5, **params))[0]
    tokens = out.output_token_ids
    assert len(out.logprobs) == len(tokens) == 12
    ref = torch.log_softmax(eng.prompt_logits(prompt + tokens[:-1])[len(prompt) - 1 :], dim=-1)
    for i, (lp, tok) in enumerate(zip(out.logprobs, tokens, strict=True)):
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[i, tok].item(), abs=1e-4)
        assert len(lp.top) == 5
        ids = [t for t, _ in lp.top]
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        assert ids == ref[i].topk(5).indices.tolist()
        assert vals == pytest.approx(ref[i].topk(5).values.tolist(), abs=1e-4)
        if tok in ids:
            assert lp.logprob == pytest.approx(vals[ids.index(tok)], abs=1e-6)
    if params["temperature"] == 0:
        assert all(lp.top[0][0] == tok for lp, tok in zip(out.logprobs, tokens, strict=True))
    else:
        assert any(lp.top[0][0] != tok for lp, tok in zip(out.logprobs, tokens, strict=True))


def test_logprobs_zero_and_none(model_dir):
    eng = make_engine(model_dir)
    zero, none = eng.generate([PROMPTS[2]] * 2, [_sp(temperature=0, logprobs=0), _sp(temperature=0)])
    assert zero.output_token_ids == none.output_token_ids
    assert none.logprobs == []
    assert len(zero.logprobs) == 12
    assert all(lp.top == () and lp.logprob <= 0.0 for lp in zero.logprobs)


# ---- filtered_probs on hand-made logits --------------------------------------------------------
ROW = torch.tensor([1.0, 3.0, 2.0, 0.5, -1.0, 2.5, 0.0, 1.5])


def _support(p: torch.Tensor) -> set[int]:
    return set(torch.nonzero(p > 0).flatten().tolist())


def _ref_top_p(probs: torch.Tensor, top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose total probability reaches top_p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    kept, total = set(), 0.0
    for i in order:
        kept.add(i)
        total += probs[i].item()
        if total >= top_p:
            break
    return kept


def test_temperature_only():
    for t in (0.5, 1.0, 3.0):
        p = filtered_probs(ROW, t, 0, 1.0)
        torch.testing.assert_close(p, torch.softmax(ROW / t, -1))
    assert filtered_probs(ROW, 0.5, 0, 1.0).max() > filtered_probs(ROW, 3.0, 0, 1.0).max()


@pytest.mark.parametrize("k", [1, 2, 3, 5, 7])
def test_top_k_keeps_exactly_k(k):
    p = filtered_probs(ROW, 1.0, k, 1.0)
    top = set(ROW.topk(k).indices.tolist())
    assert _support(p) == top and len(top) == k
    ref = torch.zeros_like(ROW)
    idx = torch.tensor(sorted(top))
    ref[idx] = torch.softmax(ROW[idx], -1)
    torch.testing.assert_close(p, ref)


@pytest.mark.parametrize("k", [0, -1, 8, 100])
def test_top_k_disabled(k):
    torch.testing.assert_close(filtered_probs(ROW, 1.0, k, 1.0), torch.softmax(ROW, -1))


def test_top_p_smallest_set():
    probs = torch.tensor([0.5, 0.05, 0.25, 0.15, 0.05])
    row = probs.log()
    cases = {
        0.3: {0},
        0.6: {0, 2},
        0.74: {0, 2},
        0.8: {0, 2, 3},
        0.85: {0, 2, 3},
        0.97: {0, 1, 2, 3, 4},
    }
    for top_p, want in cases.items():
        p = filtered_probs(row, 1.0, 0, top_p)
        assert _support(p) == want, top_p
        assert _support(p) == _ref_top_p(probs, top_p)
        idx = torch.tensor(sorted(want))
        torch.testing.assert_close(p[idx], probs[idx] / probs[idx].sum())
        assert p.sum().item() == pytest.approx(1.0, abs=1e-6)


def test_top_p_on_random_rows():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        row = torch.randn(40, generator=g) * 2
        top_p = float(torch.rand(1, generator=g) * 0.98 + 0.01)
        temp = float(torch.rand(1, generator=g) * 1.5 + 0.3)
        p = filtered_probs(row, temp, 0, top_p)
        assert _support(p) == _ref_top_p(torch.softmax(row / temp, -1), top_p)


def test_top_p_applies_after_temperature_and_top_k():
    probs = torch.tensor([0.5, 0.05, 0.25, 0.15, 0.05])
    row = probs.log()
    # flatter distribution at high temperature: top_p=0.6 needs more tokens
    hot = filtered_probs(row, 4.0, 0, 0.6)
    assert _support(hot) == _ref_top_p(torch.softmax(row / 4.0, -1), 0.6)
    assert len(_support(hot)) == 3
    # top-k first (keeps {0, 2}: renormalised 2/3, 1/3), then top_p=0.6 keeps only {0}
    assert _support(filtered_probs(row, 1.0, 2, 0.6)) == {0}
    assert _support(filtered_probs(row, 1.0, 2, 0.7)) == {0, 2}


# ---- the Sampler's draws -----------------------------------------------------------------------
def _req(rid: str, n_out: int = 0, **kw) -> Request:
    r = Request(rid, [5], SamplingParams(**kw))
    r.output_token_ids = [9] * n_out
    return r


def test_draw_frequencies_follow_filtered_probs():
    sampler = Sampler(seed=0)
    row = torch.tensor([2.0, 1.0, 0.0, 1.5, -3.0])
    want = filtered_probs(row, 0.7, 3, 1.0)
    n = 4000
    counts = torch.zeros(5)
    for tok, _ in sampler.sample(row.expand(n, 5), [_req(f"r{i}", temperature=0.7, top_k=3) for i in range(n)]):
        counts[tok] += 1
    assert counts[2] == counts[4] == 0  # outside the top 3
    assert (counts / n - want).abs().max() < 0.03, (counts / n, want)


def test_seeded_draw_depends_on_seed_and_position_only():
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(3, 50, generator=g)
    a = Sampler(seed=0).sample(rows[:1], [_req("a", n_out=4, temperature=1.0, seed=11)])[0][0]
    # other rows around it, a different sampler seed, a different request id: same draw
    b = Sampler(seed=99).sample(
        torch.stack([rows[1], rows[0], rows[2]]),
        [
            _req("x", temperature=1.0),
            _req("b", n_out=4, temperature=1.0, seed=11),
            _req("y", temperature=2.0),
        ],
    )[1][0]
    assert a == b
    draws = {Sampler().sample(rows[:1], [_req("a", n_out=i, temperature=3.0, seed=11)])[0][0] for i in range(20)}
    assert len(draws) > 5  # the step index feeds the seed: not the same token at every position
    assert all(0 <= t < 50 for t in draws)


def test_greedy_row_is_argmax_and_logprob():
    row = torch.tensor([0.1, 4.0, -2.0, 3.9])
    ((tok, lp),) = Sampler().sample(row[None], [_req("g", temperature=0, logprobs=2)])
    assert tok == 1 and lp.token_id == 1
    assert lp.logprob == pytest.approx(4.0 - math.log(row.exp().sum().item()), abs=1e-6)
    assert [t for t, _ in lp.top] == [1, 3]
