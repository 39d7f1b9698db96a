"""Handoffs pulled over lanes (engine/kv_transfer/lanes.py) between real processes, over gRPC (PullLane) and over
the prefill worker's socket data plane (engine/kv_transfer/socket_lanes.py): a decode worker that pulls each
handoff over 3 streams is token-exact, a cancelled request leaves nothing held on either side (pages, slots,
lanes), and a prefill worker killed mid-stream is an error within 2 s.

The token-exact cluster's prefill worker also encodes on its producer's encoder thread, as on a GPU
(``TANDEM_HANDOFF_ASYNC_COPIES=1``): messages leave from that thread and the step's output waits for them."""

from __future__ import annotations

import asyncio
import time

import grpc
import openai
import pytest

from engine.sampling_params import SamplingParams
from tandem.cluster import LocalCluster, WorkerSpec
from tandem.rpc import decode_pb2_grpc
from tests.conftest import make_engine, random_prompts
from tests.e2e.helpers import kill_prefill_mid_stream, scrape, wait_all_free
from tests.e2e.test_pd_faults import _decode_request

LANES = 3
MAX_TOKENS = 16
# transport -> (prefill worker's flags, decode worker's flags)
TRANSPORTS = {
    "grpc": (["--handoff-data-port", "off"], ["--handoff-lanes", str(LANES), "--handoff-transport", "grpc"]),
    "socket": (["--handoff-data-port", "0"], ["--handoff-lanes", str(LANES), "--handoff-transport", "socket"]),
}


def _lanes_served(cluster: LocalCluster, transport: str) -> float:
    key = f'tandem_prefill_lane_streams_total{{outcome="ok",transport="{transport}"}}'
    return scrape(cluster.worker("prefill").metrics_port).get(key, 0.0)


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def cluster(request, tiny_models, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("TANDEM_HANDOFF_ASYNC_COPIES", "1")  # the workers inherit it
    prefill_flags, decode_flags = TRANSPORTS[request.param]
    c = LocalCluster(
        tiny_models["kimi_linear"],
        [WorkerSpec("prefill", prefill_flags), WorkerSpec("decode", decode_flags)],
        log_dir=tmp_path_factory.mktemp(f"logs-lanes-{request.param}"),
    )
    c.transport = request.param
    try:
        c.start()
    finally:
        mp.undo()
    yield c
    c.stop()


def test_concurrent_greedy_over_lanes_is_token_exact(cluster, tiny_models):
    prompts = random_prompts(16, [1, 5, 16, 17, 33, 64, 100, 150], seed=31)
    before = {t: _lanes_served(cluster, t) for t in TRANSPORTS}

    async def run():
        client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
        try:
            return await asyncio.gather(
                *[
                    client.completions.create(
                        model=tiny_models["kimi_linear"].name,
                        prompt=p,
                        max_tokens=MAX_TOKENS,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    for p in prompts
                ]
            )
        finally:
            await client.close()

    res = asyncio.run(run())
    engine = make_engine(tiny_models["kimi_linear"])
    want = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    for p, r, w in zip(prompts, res, want, strict=True):
        assert r.choices[0].text == engine.tokenizer.decode(w.output_token_ids), f"prompt of {len(p)} tokens diverges"
    other = "grpc" if cluster.transport == "socket" else "socket"
    # every handoff went over all its lanes, on the transport asked for
    assert _lanes_served(cluster, cluster.transport) - before[cluster.transport] == 16 * (LANES - 1)
    assert _lanes_served(cluster, other) == before[other]
    ok, used, _ = wait_all_free(cluster, 2.0)
    assert ok, used


@pytest.fixture(params=list(TRANSPORTS))
def slow_prefill(request, tiny_models, tmp_path):
    # a small prefill budget makes the producer stream for a while
    prefill_flags, decode_flags = TRANSPORTS[request.param]
    c = LocalCluster(
        tiny_models["kimi_linear"],
        [WorkerSpec("prefill", ["--max-num-batched-tokens", "8", *prefill_flags]), WorkerSpec("decode", decode_flags)],
        log_dir=tmp_path / "logs",
    )
    c.start()
    yield c
    c.stop()


def _wait_live_transfer(c: LocalCluster) -> None:
    deadline = time.monotonic() + 10
    while scrape(c.worker("prefill").metrics_port)["tandem_prefill_live_transfers"] < 1:
        assert time.monotonic() < deadline, "prefill never started"
        time.sleep(0.01)


def test_cancel_over_lanes_frees_both_sides(slow_prefill):
    c = slow_prefill
    p, d = c.worker("prefill"), c.worker("decode")

    async def run():
        async with grpc.aio.insecure_channel(d.endpoint) as ch:
            call = decode_pb2_grpc.DecodeStub(ch).Generate(
                _decode_request(random_prompts(1, [1500], seed=32)[0], p.endpoint, "cancel-lanes")
            )
            await asyncio.to_thread(_wait_live_transfer, c)
            await asyncio.sleep(0.2)  # lanes are being pulled
            assert scrape(p.metrics_port)["tandem_prefill_handoffs_with_lanes"] == 1
            call.cancel()

    asyncio.run(run())
    ok, used, took = wait_all_free(c, 1.0)
    assert ok, f"still in use after {took:.2f} s: {used}"


def test_prefill_killed_while_lanes_stream_errors_within_2s(slow_prefill, tiny_models):
    kill_prefill_mid_stream(slow_prefill, tiny_models["kimi_linear"].name, random_prompts(1, [2000], seed=33)[0])


def test_a_taken_data_port_falls_back_to_grpc_lanes(tiny_models, tmp_path):
    """A prefill worker whose data port is taken logs it and serves the lanes over gRPC: requests still work."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        c = LocalCluster(
            tiny_models["kimi_linear"],
            [WorkerSpec("prefill", ["--handoff-data-port", port]), WorkerSpec("decode", TRANSPORTS["socket"][1])],
            log_dir=tmp_path / "logs",
        )
        c.start()
        try:
            client = openai.OpenAI(base_url=c.base_url, api_key="none", max_retries=0)
            prompt = random_prompts(1, [40], seed=34)[0]
            model = tiny_models["kimi_linear"].name
            r = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
            engine = make_engine(tiny_models["kimi_linear"])
            want = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0]
            assert r.choices[0].text == engine.tokenizer.decode(want.output_token_ids)
            assert _lanes_served(c, "grpc") == LANES - 1 and _lanes_served(c, "socket") == 0
        finally:
            c.stop()
