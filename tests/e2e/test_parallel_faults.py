"""A multi-rank worker fails loudly, never hangs: a dead rank fails the requests of its worker, and a
killed rank 0 takes its ranks with it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from engine.sampling_params import SamplingParams
from router.backend import GenerationRequest
from router.pd_backend import build_decode_request
from tandem.cluster import LocalCluster, WorkerSpec
from tandem.rpc import decode_pb2_grpc


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.fixture
def cluster(tiny_models, tmp_path):
    small = ["--kv-cache-memory-bytes", str(8 << 20), "--dtype", "float32"]
    workers = [WorkerSpec("prefill", [*small, "--pp", "2"]), WorkerSpec("decode", small)]
    c = LocalCluster(tiny_models["kimi_linear"], workers, log_dir=tmp_path, start_router=False)
    c.start()
    yield c
    c.stop()


async def _generate(c: LocalCluster, timeout: float) -> list[int]:
    msg = build_decode_request(
        GenerationRequest("r", [5, 6, 7, 8], SamplingParams(max_tokens=4)), c.worker("prefill").endpoint
    )
    ids: list[int] = []
    async with grpc.aio.insecure_channel(c.worker("decode").endpoint) as ch:
        async for chunk in decode_pb2_grpc.DecodeStub(ch).Generate(msg, timeout=timeout):
            ids += list(chunk.token_ids)
    return ids


def _rank0(c: LocalCluster) -> int:
    return next(p.popen.pid for p in c.procs if p.name.startswith("prefill"))


def test_a_dead_rank_fails_requests_quickly(cluster):
    assert len(asyncio.run(_generate(cluster, 60))) == 4  # serving
    (rank1,) = _children(_rank0(cluster))
    os.kill(rank1, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(_generate(cluster, 60))
    assert e.value.code() != grpc.StatusCode.DEADLINE_EXCEEDED, "a dead rank must fail the step, not hang it"
    # rank 0's engine fails the step, or the decode side sees the dead stage's stream break first
    assert "engine" in e.value.details() or "prefill stage 1" in e.value.details(), e.value.details()
    assert time.monotonic() - t0 < 30


def test_ranks_die_with_rank_0(cluster):
    rank0 = _rank0(cluster)
    ranks = _children(rank0)
    assert len(ranks) == 1
    os.kill(rank0, signal.SIGKILL)
    assert _wait_gone(ranks, 10.0) == [], "a rank outlived its rank 0"
