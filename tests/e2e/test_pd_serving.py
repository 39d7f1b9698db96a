"""Router -> prefill worker -> decode worker, as real processes on localhost.

The outputs must equal the single-process engine's token for token: KV pages, KDA state and the
first token cross the wire between two processes.
"""

from __future__ import annotations

import asyncio

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.sampling_params import SamplingParams
from tandem.cluster import LocalCluster, WorkerSpec
from tandem.rpc import router_pb2, router_pb2_grpc
from tests.conftest import make_engine, random_prompts
from tests.e2e.helpers import in_use, scrape, wait_all_free

MAX_TOKENS = 24


@pytest.fixture(scope="module", params=["kimi_linear", "qwen3"])
def cluster(request, tiny_models, tmp_path_factory):
    arch = request.param
    c = LocalCluster(tiny_models[arch], log_dir=tmp_path_factory.mktemp(f"logs-{arch}"))
    c.start()
    c.arch = arch
    yield c
    c.stop()


def _model_name(cluster: LocalCluster) -> str:
    from pathlib import Path

    return Path(cluster.model).resolve().name


async def _complete_all(cluster: LocalCluster, prompts: list[list[int]], **kw) -> list:
    client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
    try:
        return await asyncio.gather(
            *[
                client.completions.create(model=_model_name(cluster), prompt=p, max_tokens=MAX_TOKENS, **kw)
                for p in prompts
            ]
        )
    finally:
        await client.close()


def test_concurrent_greedy_is_token_exact(cluster, tiny_models):
    """16 concurrent requests of mixed lengths through router -> P -> D == the single-process engine, their
    kv / state bytes on the default data plane: one socket lane each (engine/kv_transfer/socket_lanes.py)."""
    prompts = random_prompts(16, [1, 5, 16, 17, 33, 64, 100, 150], seed=11)
    before = _socket_lanes_served(cluster)
    res = asyncio.run(_complete_all(cluster, prompts, temperature=0, extra_body={"ignore_eos": True}))
    engine = make_engine(tiny_models[cluster.arch])
    want = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    tok = engine.tokenizer
    for p, r, w in zip(prompts, res, want, strict=True):
        assert r.usage.completion_tokens == MAX_TOKENS
        assert r.choices[0].text == tok.decode(w.output_token_ids), f"prompt of {len(p)} tokens diverges"
    ok, used, _ = wait_all_free(cluster, 2.0)
    assert ok, used
    assert _socket_lanes_served(cluster) - before == len(prompts)


def _socket_lanes_served(cluster: LocalCluster) -> float:
    key = 'tandem_prefill_lane_streams_total{outcome="ok",transport="socket"}'
    return scrape(cluster.worker("prefill").metrics_port).get(key, 0.0)


def test_seeded_sampling_and_logprobs_match_single_process(cluster, tiny_models):
    """P samples the first token, D the rest: a seeded request still equals the single process."""
    prompts = random_prompts(4, [7, 40], seed=12)
    kw = dict(temperature=0.9, top_p=0.95, seed=1234, logprobs=2, extra_body={"ignore_eos": True, "top_k": 50})
    res = asyncio.run(_complete_all(cluster, prompts, **kw))
    engine = make_engine(tiny_models[cluster.arch])
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, top_k=50, seed=1234, logprobs=2, ignore_eos=True
    )
    want = engine.generate(prompts, params)
    for r, w in zip(res, want, strict=True):
        assert r.choices[0].text == engine.tokenizer.decode(w.output_token_ids)
        got_lp = r.choices[0].logprobs.token_logprobs
        assert got_lp == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-4)


def test_openai_client_stream_and_chat(cluster):
    client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
    name = _model_name(cluster)
    assert [m.id for m in client.models.list().data] == [name]
    full = client.completions.create(model=name, prompt="The quick brown fox", max_tokens=16, temperature=0)
    streamed = client.completions.create(
        model=name, prompt="The quick brown fox", max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text
    msgs = [{"role": "user", "content": "Tell me a story"}]
    chat = client.chat.completions.create(model=name, messages=msgs, max_tokens=12, temperature=0)
    chat_stream = client.chat.completions.create(model=name, messages=msgs, max_tokens=12, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices)
    assert text == chat.choices[0].message.content
    assert chat.usage.completion_tokens == 12 or chat.choices[0].finish_reason == "stop"


def test_grpc_generate_and_health(cluster, tiny_models):
    prompt = random_prompts(1, [20], seed=13)[0]

    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt))
            req.params.max_tokens = 10
            req.params.ignore_eos = True
            ids = []
            async for r in stub.Generate(req):
                ids += list(r.token_ids)
                last = r
            for w in cluster.workers:
                async with grpc.aio.insecure_channel(w.endpoint) as wch:
                    status = await health_pb2_grpc.HealthStub(wch).Check(health_pb2.HealthCheckRequest())
                    assert status.status == health_pb2.HealthCheckResponse.SERVING
            return ids, last

    ids, last = asyncio.run(run())
    want = make_engine(tiny_models[cluster.arch]).generate(
        [prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    )[0]
    assert ids == want.output_token_ids
    assert last.finished and last.finish_reason == "length" and last.completion_tokens == 10


def test_client_disconnect_frees_everything_within_1s(cluster):
    client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
    stream = client.completions.create(
        model=_model_name(cluster),
        prompt=random_prompts(1, [300], seed=14)[0],
        max_tokens=3000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for seen, _ in enumerate(stream, 1):
        if seen == 5:
            break
    assert any(v > 0 for k, v in in_use(cluster).items() if k.startswith("decode")), "decode should hold the request"
    stream.close()
    ok, used, took = wait_all_free(cluster, 1.0)
    assert ok, f"still in use after {took:.2f} s: {used}"


def test_bad_http_input_is_4xx_and_server_keeps_serving(cluster):
    import json
    import urllib.error
    import urllib.request

    def post(body: bytes) -> tuple[int, dict]:
        req = urllib.request.Request(
            cluster.base_url + "/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    name = _model_name(cluster)
    cases = [
        b"{not json",
        json.dumps({"model": name}).encode(),
        json.dumps({"model": name, "prompt": "hi", "max_tokens": -1}).encode(),
        json.dumps({"model": name, "prompt": "hi", "max_tokens": 10**9}).encode(),
        json.dumps({"model": name, "prompt": [5] * 5000, "max_tokens": 1}).encode(),
        json.dumps({"model": "no-such-model", "prompt": "hi"}).encode(),
    ]
    for body in cases:
        status, err = post(body)
        assert 400 <= status < 500, (body[:60], status, err)
        assert err["error"]["message"], err
    status, ok = post(json.dumps({"model": name, "prompt": "hi", "max_tokens": 3}).encode())
    assert status == 200 and ok["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("arch", ["kimi_linear", "qwen3"])
def test_graph_paths_on_both_workers_are_token_exact(tiny_models, tmp_path, arch):
    """--cuda-graphs on both workers. On the host the prefill worker runs its steps padded to token buckets with
    the cores cut out and the producer's per-layer hooks between the pieces (engine/prefill_graph); its
    64-token steps chunk the longer prompts, whose pages stream layer by layer from those hooks. The decode
    worker runs padded static decode steps. Tokens as the single-process engine's, nothing held after."""
    workers = [
        WorkerSpec("prefill", ["--cuda-graphs", "--max-num-batched-tokens", "64"]),
        WorkerSpec("decode", ["--cuda-graphs"]),
    ]
    c = LocalCluster(tiny_models[arch], workers=workers, log_dir=tmp_path)
    c.start()
    try:
        prompts = random_prompts(6, [1, 17, 64, 100, 150, 33], seed=21)
        res = asyncio.run(_complete_all(c, prompts, temperature=0, extra_body={"ignore_eos": True}))
        engine = make_engine(tiny_models[arch])
        want = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
        for p, r, w in zip(prompts, res, want, strict=True):
            assert r.choices[0].text == engine.tokenizer.decode(w.output_token_ids), f"{len(p)}-token prompt diverges"
        ok, used, _ = wait_all_free(c, 2.0)
        assert ok, used
        prefill = scrape(c.worker("prefill").metrics_port)
        decode = scrape(c.worker("decode").metrics_port)
        assert prefill['tandem_prefill_graph_steps{graphs="prefill",run="eager"}'] >= len(prompts)
        assert decode['tandem_decode_graph_steps{graphs="decode",run="eager"}'] >= MAX_TOKENS - 1
    finally:
        c.stop()
