"""Bad requests get clear errors, and the engine that refused them keeps serving correctly."""

from __future__ import annotations

import pytest

from engine.llm_engine import InvalidRequestError
from engine.sampling_params import SamplingParams
from tests.conftest import make_engine, random_prompts

MAX_LEN = 48
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
GOOD_PROMPT = random_prompts(1, [13], seed=21)[0]


@pytest.fixture
def engines(model_dir):
    """(engine under test, its expected greedy tokens for GOOD_PROMPT from a fresh engine)."""
    ref = make_engine(model_dir, max_model_len=MAX_LEN).generate([GOOD_PROMPT], PARAMS)[0]
    assert len(ref.output_token_ids) == 8
    return make_engine(model_dir, max_model_len=MAX_LEN), ref.output_token_ids


def _still_serves(engine, expected: list[int]) -> None:
    assert not engine.has_unfinished_requests(), "a refused request was left in the scheduler"
    assert engine.pages.num_used == 0
    assert engine.generate([GOOD_PROMPT], PARAMS)[0].output_token_ids == expected
    assert engine.pages.num_used == 0


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (random_prompts(1, [60], seed=22)[0], "prompt has 60 tokens; max_model_len is 48"),
        (random_prompts(1, [MAX_LEN], seed=23)[0], "prompt has 48 tokens; max_model_len is 48"),
        ([], "prompt is empty"),
        ([5, -1, 7], "token ids outside the vocabulary [0, 512): [-1]"),
        ([5, 512, 7, 10**9], "token ids outside the vocabulary [0, 512): [512, 1000000000]"),
        ([5, 6.0], "outside the vocabulary"),
        ([5, "7"], "outside the vocabulary"),
        ([5, 2**70], "outside the vocabulary"),
        ([5, [6, 7]], "outside the vocabulary"),
    ],
    ids=["too-long", "exactly-max-len", "empty", "negative-id", "id>=vocab", "float-id", "str-id", "huge-id", "nested"],
)
def test_bad_prompt(engines, prompt, message):
    engine, expected = engines
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(prompt, PARAMS)
    assert message in str(e.value)
    # generate() and prompt_logits() refuse it the same way
    with pytest.raises(InvalidRequestError, match=r"prompt|vocabulary"):
        engine.generate([prompt], PARAMS)
    with pytest.raises(InvalidRequestError, match=r"prompt|vocabulary"):
        engine.prompt_logits(prompt)
    _still_serves(engine, expected)


def test_longest_allowed_prompt(engines):
    engine, expected = engines
    out = engine.generate([random_prompts(1, [MAX_LEN - 1], seed=24)[0]], PARAMS)[0]
    assert len(out.output_token_ids) == 1 and out.finish_reason == "length"
    _still_serves(engine, expected)


def test_max_model_len_over_capacity(model_dir):
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds the KV cache capacity"):
        make_engine(model_dir, max_model_len=100_000)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be a positive integer, got 0"),
        ({"max_tokens": -3}, "max_tokens must be a positive integer, got -3"),
        ({"max_tokens": 2.5}, "max_tokens must be a positive integer, got 2.5"),
        ({"temperature": -0.1}, "temperature must be >= 0, got -0.1"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": -0.2}, "top_p must be in (0, 1], got -0.2"),
        ({"top_k": -2}, "top_k must be -1, 0 or positive, got -2"),
        ({"logprobs": 21}, "logprobs must be in [0, 20], got 21"),
        ({"logprobs": -1}, "logprobs must be in [0, 20], got -1"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)


def test_edge_sampling_params_accepted():
    p = SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, logprobs=20)
    assert p.greedy
    assert SamplingParams(stop_token_ids=[5, 7]).stop_token_ids == (5, 7)


def test_params_of_wrong_type(engines):
    engine, expected = engines
    with pytest.raises(InvalidRequestError, match="params must be SamplingParams, got dict"):
        engine.add_request(GOOD_PROMPT, {"max_tokens": 4})  # type: ignore[arg-type]
    _still_serves(engine, expected)


def test_duplicate_request_id(engines):
    engine, expected = engines
    assert engine.add_request(GOOD_PROMPT, PARAMS, request_id="x") == "x"
    engine.step()
    with pytest.raises(InvalidRequestError, match="request id 'x' is already in use"):
        engine.add_request(random_prompts(1, [5], seed=25)[0], PARAMS, request_id="x")
    # the first 'x' is untouched by the refused duplicate
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id == "x"
            outs[o.request_id] = o
    assert outs["x"].output_token_ids == expected
    assert outs["x"].prompt_token_ids == GOOD_PROMPT
    # once finished, the id may be used again
    engine.add_request(GOOD_PROMPT, PARAMS, request_id="x")
    engine.abort_request("x")
    _still_serves(engine, expected)


def test_errors_between_steps_do_not_disturb_running_requests(engines):
    """Refusals while other requests are mid-generation leave them (and their tokens) intact."""
    engine, expected = engines
    rid = engine.add_request(GOOD_PROMPT, PARAMS)
    engine.step()
    engine.step()
    for bad in ([], [-5], [600], random_prompts(1, [MAX_LEN + 3], seed=26)[0]):
        with pytest.raises(InvalidRequestError):
            engine.add_request(bad, PARAMS)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[rid].output_token_ids == expected
    _still_serves(engine, expected)


def test_numpy_and_bool_ids_become_python_ints(engines):
    """Token ids given as numpy ints (or bools) are accepted and stored as Python ints: outputs serialise them."""
    import numpy as np

    engine, _ = engines
    rid = engine.add_request([np.int64(5), True, 7], PARAMS)
    req = engine._requests[rid]
    assert req.prompt_token_ids == [5, 1, 7] and all(type(t) is int for t in req.prompt_token_ids)
    assert req.prompt_array().tolist() == [5, 1, 7]
    engine.abort_request(rid)
