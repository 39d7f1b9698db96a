"""The rule "a prefill worker never speculates", enforced at three places."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import pytest

from engine.config import EngineConfig, SpeculativeConfig
from engine.sampling_params import SamplingParams
from prefill_svc.config import PrefillConfig, ProducerSpeculationError
from router.backend import GenerationRequest, SpeculativeParams
from router.pd_backend import build_decode_request, build_prefill_request
from router.workers import RegistrationError, WorkerRegistry, check_worker_info
from tandem.rpc import common_pb2 as cpb
from tandem.rpc import prefill_pb2_grpc


@pytest.mark.parametrize(
    "spec",
    [
        SpeculativeConfig(method="ngram", num_speculative_tokens=3),
        SpeculativeConfig(method="aux_tap", num_speculative_tokens=2, draft_model="/some/drafter"),
        SpeculativeConfig(draft_model="/some/drafter"),
    ],
)
def test_prefill_config_refuses_any_speculative_setting(spec):
    with pytest.raises(ProducerSpeculationError, match="never speculates"):
        PrefillConfig(EngineConfig(model="unused"), speculative=spec)


def test_prefill_worker_refuses_to_start(tiny_models):
    r = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "prefill", "--model", str(tiny_models["qwen3"]),
         "--speculative-method", "ngram", "--num-speculative-tokens", "3"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    assert "a prefill worker never speculates" in r.stderr


def test_router_strips_speculative_params_from_prefill():
    req = GenerationRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4), SpeculativeParams(5))
    assert not build_prefill_request(req).HasField("speculative")
    dec = build_decode_request(req, "127.0.0.1:1")
    assert dec.speculative.num_speculative_tokens == 5  # decode is the one that gets them
    assert not dec.prefill.HasField("speculative")


def test_router_refuses_speculating_producer_info():
    info = cpb.WorkerInfo(role=cpb.PREFILL, speculative=True, speculative_method="ngram", num_speculative_tokens=3)
    with pytest.raises(RegistrationError, match="a producer never speculates"):
        check_worker_info("p:1", "prefill", info)
    check_worker_info("d:1", "decode", cpb.WorkerInfo(role=cpb.DECODE, speculative=True, num_speculative_tokens=3))
    with pytest.raises(RegistrationError, match="reports role decode"):
        check_worker_info("x:1", "prefill", cpb.WorkerInfo(role=cpb.DECODE))


class _SpeculatingPrefill(prefill_pb2_grpc.PrefillServicer):
    """A misconfigured producer that reports speculation (what the router must refuse)."""

    async def Info(self, request, context):
        return cpb.WorkerInfo(role=cpb.PREFILL, speculative=True, speculative_method="aux_tap", model_name="m")


def test_router_registry_refuses_speculating_producer_over_grpc():
    async def run():
        server = grpc.aio.server()
        prefill_pb2_grpc.add_PrefillServicer_to_server(_SpeculatingPrefill(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            with pytest.raises(RegistrationError, match="refusing prefill worker"):
                await WorkerRegistry().register(f"127.0.0.1:{port}", "prefill")
        finally:
            await server.stop(0)

    asyncio.run(run())


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["--prefill-args", "--handoff-data-port", "0"], (["--handoff-data-port", "0"], [])),
        (["--decode-args", "--handoff-transport", "socket"], ([], ["--handoff-transport", "socket"])),
        (
            ["--prefill-args", "--handoff-data-port", "0", "--decode-args", "--handoff-transport", "socket"],
            (["--handoff-data-port", "0"], ["--handoff-transport", "socket"]),
        ),
        (
            ["--decode-args", "--cuda-graphs", "--prefill-args", "--max-num-batched-tokens", "8"],
            (["--max-num-batched-tokens", "8"], ["--cuda-graphs"]),
        ),
    ],
    ids=["prefill", "decode", "prefill then decode", "decode then prefill"],
)
def test_serve_splits_the_workers_flags(argv, want):
    """`tandem serve`'s --prefill-args / --decode-args each take the rest of the line; both together still
    reach their own worker (so a speculative flag meant for decode never lands on prefill)."""
    from tandem.cli import build_parser, worker_args

    assert worker_args(build_parser().parse_args(["serve", *argv])) == want
