"""Speculative decoding through router -> prefill -> decode: lossless, and drafting from the first
decode step (the producer sends the target's aux hidden states; it never drafts)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import openai
import pytest

from engine.sampling_params import SamplingParams
from engine.spec.aux_tap import make_tiny_drafter
from tandem.cluster import LocalCluster, WorkerSpec
from tandem.rpc import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from tests.conftest import make_engine, random_prompts
from tests.e2e.helpers import scrape

MAX_TOKENS = 24


def _prompts() -> list[list[int]]:
    return [random_prompts(1, [10], seed=60)[0] * 3, *random_prompts(3, [7, 40, 90], seed=61)]


PARALLEL = (["--pcp", "2", "--pp", "2"], ["--pp", "2"])  # producer taps from 4 ranks; a pp=2 consumer verifies
CASES = [("kimi_linear", "aux_tap", None), ("qwen3", "aux_tap", None), ("qwen3", "ngram", None)]
CASES += [("kimi_linear", "aux_tap", PARALLEL)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{m}{'-parallel' if p else ''}" for a, m, p in CASES])
def cluster(request, tiny_models, tmp_path_factory):
    arch, method, layouts = request.param
    prefill_args, decode_args = layouts or ([], [])
    spec = ["--speculative-method", method, "--num-speculative-tokens", "7"]
    if method == "aux_tap":
        drafter = make_tiny_drafter(tmp_path_factory.mktemp("drafter") / arch, tiny_models[arch], (-1, 1, 2))
        spec += ["--draft-model", str(drafter)]
    c = LocalCluster(
        tiny_models[arch],
        [WorkerSpec("prefill", prefill_args), WorkerSpec("decode", decode_args + spec)],
        log_dir=tmp_path_factory.mktemp(f"spec-logs-{arch}-{method}"),
    )
    c.start()
    c.arch, c.method = arch, method
    yield c
    c.stop()


def test_lossless_through_router_for_k_1_3_7(cluster, tiny_models):
    prompts = _prompts()
    client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
    name = Path(cluster.model).resolve().name

    async def run():
        try:
            return await asyncio.gather(
                *[
                    client.completions.create(
                        model=name,
                        prompt=p,
                        max_tokens=MAX_TOKENS,
                        temperature=0,
                        extra_body={"ignore_eos": True, "num_speculative_tokens": k},
                    )
                    for k in (1, 3, 7)
                    for p in prompts
                ]
            )
        finally:
            await client.close()

    got = asyncio.run(run())
    engine = make_engine(tiny_models[cluster.arch])
    want = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    texts = [engine.tokenizer.decode(w.output_token_ids) for w in want] * 3
    assert [r.choices[0].text for r in got] == texts
    m = scrape(cluster.worker("decode").metrics_port)
    assert m["tandem_decode_spec_verify_steps_total"] > 0
    assert m["tandem_decode_spec_draft_tokens_total"] >= m["tandem_decode_spec_accepted_tokens_total"]


def test_first_decode_step_drafts_and_producer_never_speculates(cluster, tiny_models):
    prompt = _prompts()[2]
    req = decode_pb2.DecodeRequest(request_id="spec-first", prefill_endpoint=cluster.worker("prefill").endpoint)
    req.params.max_tokens = MAX_TOKENS
    req.params.ignore_eos = True
    req.prefill.prompt_token_ids.extend(prompt)
    req.prefill.params.CopyFrom(req.params)
    req.speculative.num_speculative_tokens = 3

    async def run():
        async with grpc.aio.insecure_channel(cluster.worker("decode").endpoint) as ch:
            chunks = [c async for c in decode_pb2_grpc.DecodeStub(ch).Generate(req, timeout=60)]
        async with grpc.aio.insecure_channel(cluster.worker("prefill").endpoint) as ch:
            info = await prefill_pb2_grpc.PrefillStub(ch).Info(common_pb2.WorkerInfoRequest())
        return chunks, info

    chunks, info = asyncio.run(run())
    last = chunks[-1]
    n_tokens = sum(len(c.token_ids) for c in chunks)
    assert n_tokens == MAX_TOKENS and last.finished
    assert list(chunks[0].token_ids) and chunks[0].num_verify_steps == 0  # the producer's token
    assert not info.speculative and info.num_speculative_tokens == 0
    if cluster.method != "aux_tap":
        return  # n-gram drafts only when the text repeats
    # the aux-tap drafter reads the hidden states sent by the producer: the first decode step verifies
    assert chunks[1].num_verify_steps == 1 and chunks[1].num_drafted == 3
    # every later step verified too, except a last one-token step (no room left to draft)
    assert n_tokens - 1 - (last.num_accepted + last.num_verify_steps) in (0, 1)
