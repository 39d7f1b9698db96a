"""Parallel prefill -> parallel decode, as real processes: heterogeneous layouts, token-exact.

One cluster per model family holds two prefill workers (pcp=2 x pp=2, and pp=4) and two decode
workers (tp=2, and tp=1). Each decode worker is asked directly (gRPC Decode.Generate, naming the
prefill endpoint) so every producer layout hands over to every consumer layout; one pairing also goes
through the router. The KV pages and KDA state of a pcp x pp producer come from four ranks, relayed
through its rank 0; a tp=2 consumer reslices them by head. Tokens must equal the single-process engine.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import grpc
import openai
import pytest

from engine.kv_transfer import wire
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.backend import GenerationRequest
from router.pd_backend import build_decode_request
from tandem.cluster import LocalCluster, WorkerSpec
from tandem.rpc import common_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.conftest import make_engine, random_prompts
from tests.e2e.helpers import wait_all_free

MAX_TOKENS = 10
PREFILL_LAYOUTS = (["--pcp", "2", "--pp", "2"], ["--pp", "4"])
DECODE_LAYOUTS = (["--tp", "2"], [])
# 64 and 100 tokens: several pages; 1: a single row (most PCP ranks hold only padding); 37: odd length
PROMPT_LENS = [1, 37, 64, 100]


@pytest.fixture(scope="module", params=["kimi_linear", "qwen3"])
def cluster(request, tiny_models, tmp_path_factory):
    arch = request.param
    small = ["--max-num-batched-tokens", "48", "--kv-cache-memory-bytes", str(8 << 20), "--dtype", "float32"]
    workers = [WorkerSpec("prefill", small + a) for a in PREFILL_LAYOUTS]
    workers += [WorkerSpec("decode", small + a) for a in DECODE_LAYOUTS]
    logs = tmp_path_factory.mktemp(f"logs-parallel-{arch}")
    c = LocalCluster(tiny_models[arch], workers, log_dir=logs, start_router=False)
    c.start()
    c.arch = arch
    yield c
    c.stop()


@pytest.fixture(scope="module")
def expected(cluster, tiny_models) -> tuple[list[list[int]], list[list[int]]]:
    prompts = random_prompts(4, PROMPT_LENS, seed=21)
    engine = make_engine(tiny_models[cluster.arch])
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return prompts, [o.output_token_ids for o in outs]


async def _decode(endpoint: str, prefill_endpoint: str, rid: str, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    msg = build_decode_request(GenerationRequest(rid, prompt, params), prefill_endpoint)
    ids: list[int] = []
    async with grpc.aio.insecure_channel(endpoint) as ch:
        async for chunk in decode_pb2_grpc.DecodeStub(ch).Generate(msg, timeout=120):
            ids += list(chunk.token_ids)
    return ids


def test_every_prefill_layout_hands_over_to_every_decode_layout(cluster, expected):
    prompts, want = expected
    prefills = [w for w in cluster.workers if w.role == "prefill"]
    decodes = [w for w in cluster.workers if w.role == "decode"]

    async def run():
        jobs = []
        for (pi, p), (di, d) in itertools.product(enumerate(prefills), enumerate(decodes)):
            for k, prompt in enumerate(prompts):
                jobs.append(((pi, di, k), _decode(d.endpoint, p.endpoint, f"r-{pi}-{di}-{k}", prompt)))
        got = await asyncio.gather(*(j for _, j in jobs))
        return {key: ids for (key, _), ids in zip(jobs, got, strict=True)}

    got = asyncio.run(run())
    for (pi, di, k), ids in got.items():
        layout = f"prefill {PREFILL_LAYOUTS[pi] or 'single'} -> decode {DECODE_LAYOUTS[di] or 'single'}"
        assert ids == want[k], f"{cluster.arch}: {layout}, prompt of {len(prompts[k])} tokens diverges"
    ok, used, _ = wait_all_free(cluster, 5.0)
    assert ok, used


def test_router_over_parallel_workers(cluster, expected):
    """The router registers a multi-rank worker as one endpoint (pcp=2 x pp=2 prefill -> tp=2 decode)."""
    prompts, want = expected
    prefill, decode = cluster.worker("prefill", 0), cluster.worker("decode", 0)
    cluster.router([("prefill", prefill.endpoint), ("decode", decode.endpoint)], 60)
    client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
    tok = Tokenizer(cluster.model)
    for prompt, w in zip(prompts, want, strict=True):
        r = client.completions.create(
            model=Path(cluster.model).resolve().name,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].text == tok.decode(w)


def test_pipelined_prefill_streams_every_stage_directly(cluster, expected):
    """A pp=4 prefill worker's Prefill stream carries stage 0's layers and announces stages 1-3, each of
    which streams its own layers (then an end marker counting them) from its own endpoint."""
    prompts, _ = expected
    prefill = cluster.worker("prefill", 1)  # --pp 4
    assert PREFILL_LAYOUTS[1] == ["--pp", "4"]

    async def run():
        async with grpc.aio.insecure_channel(prefill.endpoint) as ch:
            info = await prefill_pb2_grpc.PrefillStub(ch).Info(common_pb2.WorkerInfoRequest())
            req = prefill_pb2.PrefillRequest(request_id="stages", prompt_token_ids=prompts[2])
            req.params.max_tokens = 1
            req.consumer_fingerprint.CopyFrom(info.fingerprint)
            main = [m async for m in prefill_pb2_grpc.PrefillStub(ch).Prefill(req, timeout=60)]
        stages = {}
        for s in main[0].header.stage_streams:
            async with grpc.aio.insecure_channel(s.endpoint) as ch:
                pull = wire.stage_pull_call(ch)(prefill_pb2.StagePullRequest(request_id="stages", stage=s.stage))
                stages[s.stage] = (set(s.layers), await _all(pull))  # parsed by wire.parse_chunk
        return main, stages

    main, stages = asyncio.run(run())
    assert sorted(stages) == [1, 2, 3] and all(layers for layers, _ in stages.values())
    layer_of = lambda m: m.kv.layer if m.HasField("kv") else m.state.layer
    sent_main = {layer_of(m) for m in main if m.HasField("kv") or m.HasField("state")}
    assert sent_main and not sent_main & set().union(*(layers for layers, _ in stages.values()))
    for stage, (layers, msgs) in stages.items():
        chunks = [getattr(m, "chunk", m) for m in msgs]
        parts = [c for c in chunks if c.HasField("kv") or c.HasField("state")]
        assert parts and {layer_of(c) for c in parts} <= layers, stage
        assert chunks[-1].HasField("end") and chunks[-1].end.num_messages == len(parts), stage
    ok, used, _ = wait_all_free(cluster, 5.0)
    assert ok, used


async def _all(call):
    return [m async for m in call]
