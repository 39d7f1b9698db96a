"""Prefix hits across prefill replicas through the LMCache tier and the Redis index (real
redis-server on a free port, real LMCache, real worker processes)."""

from __future__ import annotations

import asyncio
import time

import grpc
import openai
import pytest

from engine.block_hash import block_hashes, namespace
from engine.fingerprint import model_digest
from engine.sampling_params import SamplingParams
from tandem.cluster import LocalCluster, WorkerSpec
from tandem.rpc import decode_pb2, decode_pb2_grpc
from tests.conftest import make_engine, random_prompts
from tests.e2e.helpers import scrape
from tests.e2e.redis_server import RedisServer

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def redis_server():
    r = RedisServer().start()
    yield r
    r.stop()


def _tier_cluster(model, redis_url, log_dir, prefill_extra=(), decode_files=True) -> LocalCluster:
    flags = ["--enable-prefix-caching", "--redis-url", redis_url]
    return LocalCluster(
        model,
        [
            WorkerSpec("prefill", flags + list(prefill_extra)),
            WorkerSpec("prefill", flags),
            WorkerSpec("decode", flags if decode_files else []),
        ],
        router_args=["--redis-url", redis_url],
        log_dir=log_dir,
    )


@pytest.fixture(scope="module", params=["kimi_linear", "qwen3"])
def cluster(request, tiny_models, redis_server, tmp_path_factory):
    redis_server.client().flushall()
    c = _tier_cluster(tiny_models[request.param], redis_server.url, tmp_path_factory.mktemp("tier-logs"))
    c.start()
    c.arch = request.param
    yield c
    c.stop()


def _via(cluster: LocalCluster, prefill: int, prompt: list[int], rid: str) -> list[int]:
    """Decode through a chosen prefill replica (bypassing the router's choice)."""
    req = decode_pb2.DecodeRequest(request_id=rid, prefill_endpoint=cluster.worker("prefill", prefill).endpoint)
    req.params.max_tokens = MAX_TOKENS
    req.params.ignore_eos = True
    req.prefill.prompt_token_ids.extend(prompt)
    req.prefill.params.CopyFrom(req.params)

    async def run():
        async with grpc.aio.insecure_channel(cluster.worker("decode").endpoint) as ch:
            ids = []
            async for chunk in decode_pb2_grpc.DecodeStub(ch).Generate(req, timeout=60):
                ids += list(chunk.token_ids)
            return ids

    return asyncio.run(run())


def _metrics(cluster, i):
    return scrape(cluster.worker("prefill", i).metrics_port)


def _wait_filed(cluster, i, min_bytes=1):
    deadline = time.monotonic() + 10
    last = -1.0
    while True:  # filing is asynchronous: wait until the filed byte count stops moving
        now = _metrics(cluster, i)["tandem_prefill_filed_bytes"]
        if now >= min_bytes and now == last:
            return now
        assert time.monotonic() < deadline, "prefill worker never filed its pages"
        last = now
        time.sleep(0.2)


def _reference(model_dir, prompts):
    engine = make_engine(model_dir)
    return [
        o.output_token_ids
        for o in engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    ]


def test_other_replica_is_served_from_the_tier(cluster, tiny_models, redis_server):
    base = random_prompts(1, [300], seed=41)[0]
    first = _via(cluster, 0, base, "warm-0")
    _wait_filed(cluster, 0)
    # the decode worker registered the prompt pages it received (and generated) under the same hashes
    ns = namespace(model_digest(cluster.model), "")
    want_hashes = {h.hex() for h in block_hashes(ns, base, 16)}
    deadline = time.monotonic() + 5
    key = f"tandem:g:{cluster.worker('decode').endpoint}"
    while not want_hashes <= {m.decode() for m in redis_server.client().smembers(key)}:
        assert time.monotonic() < deadline, "decode worker did not register the block hashes it received"
        time.sleep(0.1)
    cases = {
        "between_rungs": base[:150] + [7, 8, 9],  # 9 full shared pages; rungs every 4 pages
        "on_rung": base[:200] + [7, 8],  # 12 full shared pages: a rung
    }
    got, hits = {}, {}
    for name, prompt in cases.items():
        before = _metrics(cluster, 1)
        got[name] = _via(cluster, 1, prompt, f"tier-{name}")
        after = _metrics(cluster, 1)
        hits[name] = {
            k: after[f"tandem_prefill_{k}"] - before[f"tandem_prefill_{k}"]
            for k in ("tier_hit_tokens", "prefix_hit_tokens", "prefix_resume_tokens")
        }
        _wait_filed(cluster, 1, min_bytes=0)
    want = _reference(tiny_models[cluster.arch], [base, *cases.values()])
    assert [first, *got.values()] == want
    assert hits["between_rungs"]["tier_hit_tokens"] == 144
    assert hits["between_rungs"]["prefix_hit_tokens"] == 144
    assert hits["on_rung"]["prefix_hit_tokens"] == 192
    if cluster.arch == "kimi_linear":  # KDA resumes at the last rung at or below the match
        assert hits["between_rungs"]["prefix_resume_tokens"] == 128
        assert hits["on_rung"]["prefix_resume_tokens"] == 192
    else:
        assert hits["between_rungs"]["prefix_resume_tokens"] == 144


def test_corrupted_tier_entry_is_recomputed(cluster, tiny_models, redis_server):
    base = random_prompts(1, [120], seed=42)[0]
    _via(cluster, 0, base, "corrupt-warm")
    _wait_filed(cluster, 0)
    r = redis_server.client()
    damaged = 0
    for key in r.scan_iter(match="*kv_bytes"):
        data = bytearray(r.get(key))
        data[len(data) // 2] ^= 0xFF
        r.set(key, bytes(data))
        damaged += 1
    assert damaged > 0
    before = _metrics(cluster, 1)["tandem_prefill_corrupt_entries"]
    prompt = base[:100] + [5, 6]
    got = _via(cluster, 1, prompt, "corrupt-read")
    assert got == _reference(tiny_models[cluster.arch], [prompt])[0]
    assert _metrics(cluster, 1)["tandem_prefill_corrupt_entries"] > before


def test_multi_turn_chat_hits_on_second_turn(cluster):
    client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
    name = cluster.workers[0] and __import__("pathlib").Path(cluster.model).resolve().name
    msgs = [{"role": "user", "content": "Tell me a long story about a fox who lived in a quiet forest. " * 4}]
    first = client.chat.completions.create(model=name, messages=msgs, max_tokens=16, temperature=0)
    before = sum(_metrics(cluster, i)["tandem_prefill_prefix_hit_tokens"] for i in (0, 1))
    msgs += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "More."}]
    client.chat.completions.create(model=name, messages=msgs, max_tokens=4, temperature=0)
    after = sum(_metrics(cluster, i)["tandem_prefill_prefix_hit_tokens"] for i in (0, 1))
    assert after - before >= 48, (before, after)
    assert scrape_router(cluster)["tandem_router_prefix_routed"] >= 1


def scrape_router(cluster):
    import urllib.request

    from tests.e2e.helpers import _parse

    return _parse(urllib.request.urlopen(cluster.base_url.removesuffix("/v1") + "/metrics", timeout=5).read().decode())


def test_redis_outage_serves_without_hits_then_recovers(cluster, tiny_models, redis_server):
    prompts = random_prompts(2, [140], seed=43)
    errors_before = _metrics(cluster, 1)["tandem_prefill_index_errors"]
    redis_server.stop()
    try:
        got = [_via(cluster, 1, p, f"outage-{i}") for i, p in enumerate(prompts)]
        assert got == _reference(tiny_models[cluster.arch], prompts)
        assert _metrics(cluster, 1)["tandem_prefill_index_errors"] > errors_before
    finally:
        redis_server.start()
    # back: new prefixes are filed and hit again from the other replica (entries that failed to file
    # during the outage are simply not cached)
    deadline = time.monotonic() + 20
    for attempt in range(100):
        base = random_prompts(1, [200], seed=100 + attempt)[0]
        _via(cluster, 0, base, f"back-warm-{attempt}")
        _wait_filed(cluster, 0)
        before = _metrics(cluster, 1)["tandem_prefill_tier_hit_tokens"]
        prompt = base[:180] + [3, 4]
        out = _via(cluster, 1, prompt, f"back-{attempt}")
        if _metrics(cluster, 1)["tandem_prefill_tier_hit_tokens"] > before:
            break
        assert time.monotonic() < deadline, "tier hits did not resume after redis came back"
        time.sleep(0.5)
    assert out == _reference(tiny_models[cluster.arch], [prompt])[0]


def test_small_tier_evicts_consistently(tiny_models, redis_server, tmp_path):
    redis_server.client().flushall()
    c = _tier_cluster(
        tiny_models["kimi_linear"],
        redis_server.url,
        tmp_path / "logs",
        prefill_extra=["--tier-capacity-bytes", "150000"],
        decode_files=False,  # only the small-tier replica files, so its evictions are what the index shows
    )
    c.start()
    try:
        prompts = random_prompts(6, [130], seed=45)
        for i, p in enumerate(prompts):
            _via(c, 0, p, f"evict-{i}")
        _wait_filed(c, 0)
        m = _metrics(c, 0)
        assert m["tandem_prefill_tier_evictions"] > 0
        assert m["tandem_prefill_tier_bytes"] <= 150000
        r = redis_server.client()
        # LMCache keys: <model>@1@0@<hex of the hash's first 8 bytes>@uint8@kind%<1|2>kv_bytes
        stored = {
            tuple(k.decode().removesuffix("kv_bytes").split("@")[i] for i in (3, 5))
            for k in r.scan_iter(match="*kv_bytes")
        }
        entries = {k.decode()[len("tandem:e:") :]: r.hgetall(k) for k in r.scan_iter(match="tandem:e:*")}
        listed = [
            (h, kind) for h, f in entries.items() for kind, field in ((1, b"kv"), (2, b"kda")) if f.get(field) == b"1"
        ]
        unlisted = [
            (h, kind) for h, f in entries.items() for kind, field in ((1, b"kv"), (2, b"kda")) if f.get(field) == b"0"
        ]
        assert listed, "nothing left in the index"
        assert unlisted, "evictions must be mirrored in the index"
        for hex_hash, kind in listed:  # the index never points at an entry the tier no longer holds
            chunk = int.from_bytes(bytes.fromhex(hex_hash)[:8], "big", signed=True)
            assert (f"{chunk:x}", f"kind%{kind}") in stored, f"index lists {hex_hash[:16]}/{kind}, the tier has none"
        # every index entry that says "in the tier" must be served from the tier
        for p in prompts[-1:]:
            before = _metrics(c, 1)["tandem_prefill_tier_hit_tokens"]
            out = _via(c, 1, p[:128] + [9, 9], "evict-check")
            assert out == _reference(tiny_models["kimi_linear"], [p[:128] + [9, 9]])[0]
            assert _metrics(c, 1)["tandem_prefill_tier_hit_tokens"] - before == 128
    finally:
        c.stop()
