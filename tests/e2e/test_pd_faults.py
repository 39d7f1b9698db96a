"""Failures between real processes: a producer killed mid-stream, corrupted or incomplete payloads,
mismatched fingerprints. Each must end in a clear error, never in decoded tokens or held memory."""

from __future__ import annotations

import asyncio
import struct
import time

import grpc
import pytest

from engine.kv_transfer.socket_lanes import ERROR_FLAG
from engine.tiny_model import make_tiny_model
from tandem.cluster import LocalCluster, WorkerSpec
from tandem.rpc import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.conftest import random_prompts
from tests.e2e.helpers import kill_prefill_mid_stream, scrape, wait_all_free


def _decode_request(prompt: list[int], prefill_endpoint: str, rid: str) -> decode_pb2.DecodeRequest:
    req = decode_pb2.DecodeRequest(request_id=rid, prefill_endpoint=prefill_endpoint)
    req.params.max_tokens = 8
    req.params.ignore_eos = True
    req.prefill.request_id = rid
    req.prefill.prompt_token_ids.extend(prompt)
    req.prefill.params.CopyFrom(req.params)
    return req


async def _decode(endpoint: str, req: decode_pb2.DecodeRequest) -> list[int]:
    async with grpc.aio.insecure_channel(endpoint) as ch:
        ids = []
        async for chunk in decode_pb2_grpc.DecodeStub(ch).Generate(req, timeout=30):
            ids += list(chunk.token_ids)
        return ids


def _damage(msg_bytes: bytes, mode: str) -> bytes | None:
    """One kv / state message's bytes, damaged: a payload byte flipped (deep in the message, past its small
    header), or the message dropped (None)."""
    if mode == "drop":
        return None
    data = bytearray(msg_bytes)
    data[len(data) * 3 // 4] ^= 0x40
    return bytes(data)


class CorruptingProxy(prefill_pb2_grpc.PrefillServicer):
    """Sits between decode and prefill; damages the first kv / state message on purpose, wherever it travels:
    on the Prefill stream (transport "grpc": the request is rewritten to ask for no lanes) or on a socket lane
    (transport "socket": the header's data endpoint is rewritten to a relay of this proxy's own)."""

    def __init__(self, upstream: str, mode: str, transport: str) -> None:
        self.upstream = upstream
        self.mode = mode
        self.transport = transport
        self.relay: asyncio.Server | None = None

    async def Info(self, request, context):
        async with grpc.aio.insecure_channel(self.upstream) as ch:
            return await prefill_pb2_grpc.PrefillStub(ch).Info(request)

    async def Prefill(self, request, context):
        if self.transport == "grpc":
            request.socket_lanes, request.lanes = False, 1
        async with grpc.aio.insecure_channel(self.upstream) as ch:
            damaged = False
            async for msg in prefill_pb2_grpc.PrefillStub(ch).Prefill(request):
                which = msg.WhichOneof("payload")
                if which == "header" and self.transport == "socket":
                    assert msg.header.data_endpoint, "the prefill worker serves no socket lanes"
                    msg.header.data_endpoint = await self._relay_to(msg.header.data_endpoint)
                if not damaged and which in ("kv", "state"):
                    damaged = True
                    damaged_bytes = _damage(msg.SerializeToString(), self.mode)
                    if damaged_bytes is None:
                        continue
                    msg = prefill_pb2.HandoffChunk.FromString(damaged_bytes)
                yield msg

    async def _relay_to(self, endpoint: str) -> str:
        """A TCP relay to the producer's socket data plane that damages the first message it passes."""
        host, port = endpoint.rsplit(":", 1)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            up_r, up_w = await asyncio.open_connection(host, int(port))

            async def consumer_to_producer():
                while data := await reader.read(1 << 16):
                    up_w.write(data)
                    await up_w.drain()

            forward = asyncio.create_task(consumer_to_producer())
            damaged = False
            try:
                while head := await _read_or_none(up_r, 4):
                    (word,) = struct.unpack("<I", head)
                    frame = await up_r.readexactly(word & ~ERROR_FLAG)
                    if not damaged and not word & ERROR_FLAG:  # the first kv / state message
                        damaged = True
                        frame = _damage(frame, self.mode)
                        if frame is None:
                            continue
                    writer.write(struct.pack("<I", len(frame) | (word & ERROR_FLAG)) + frame)
                    await writer.drain()
            finally:
                forward.cancel()
                up_w.close()
                writer.close()

        if self.relay is None:
            self.relay = await asyncio.start_server(handle, "127.0.0.1", 0)
        return f"127.0.0.1:{self.relay.sockets[0].getsockname()[1]}"


async def _read_or_none(reader: asyncio.StreamReader, n: int) -> bytes | None:
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError:
        return None


@pytest.fixture(scope="module")
def workers(tiny_models, tmp_path_factory):
    other = make_tiny_model(tmp_path_factory.mktemp("other") / "kimi-seed1", arch="kimi_linear", seed=1)
    c = LocalCluster(
        tiny_models["kimi_linear"],
        [WorkerSpec("prefill"), WorkerSpec("decode"), WorkerSpec("decode", ["--model", str(other)])],
        log_dir=tmp_path_factory.mktemp("fault-logs"),
        start_router=False,
    )
    c.start()
    yield c
    c.stop()


@pytest.mark.parametrize("transport", ["socket", "grpc"])
@pytest.mark.parametrize("mode,needle", [("flip", "checksum mismatch"), ("drop", "end marker says")])
def test_damaged_handoff_is_refused_and_freed(workers, mode, needle, transport):
    p, d = workers.worker("prefill"), workers.worker("decode", 0)
    prompt = random_prompts(1, [70], seed=21)[0]

    async def run():
        server = grpc.aio.server()
        proxy = CorruptingProxy(p.endpoint, mode, transport)
        prefill_pb2_grpc.add_PrefillServicer_to_server(proxy, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _decode(d.endpoint, _decode_request(prompt, f"127.0.0.1:{port}", f"bad-{mode}-{transport}"))
            return err.value
        finally:
            await server.stop(0)
            if proxy.relay is not None:
                proxy.relay.close()

    err = asyncio.run(run())
    assert err.code() == grpc.StatusCode.DATA_LOSS
    assert needle in err.details()
    deadline = time.monotonic() + 2  # the reservation is released as the refused stream unwinds
    while (m := scrape(d.metrics_port))["tandem_decode_pages_in_use"] or m["tandem_decode_slots_in_use"]:
        assert time.monotonic() < deadline, m
        time.sleep(0.02)
    # the same workers still serve an intact request
    assert len(asyncio.run(_decode(d.endpoint, _decode_request(prompt, p.endpoint, f"ok-{mode}-{transport}")))) == 8


def test_fingerprint_mismatch_is_refused(workers):
    p, other = workers.worker("prefill"), workers.worker("decode", 1)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(_decode(other.endpoint, _decode_request([5, 6, 7], p.endpoint, "fp")))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "fingerprint" in err.value.details() and "model_digest" in err.value.details()
    deadline = time.monotonic() + 2
    while scrape(other.metrics_port)["tandem_decode_pages_in_use"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_prefill_killed_mid_stream_errors_within_2s(tiny_models, tmp_path):
    # a small prefill budget makes the producer stream for a while; it is killed in the middle
    c = LocalCluster(
        tiny_models["kimi_linear"],
        [WorkerSpec("prefill", ["--max-num-batched-tokens", "8"]), WorkerSpec("decode")],
        log_dir=tmp_path / "logs",
    )
    c.start()
    try:
        kill_prefill_mid_stream(c, tiny_models["kimi_linear"].name, random_prompts(1, [2000], seed=22)[0])
    finally:
        c.stop()


def test_cancel_during_prefill_frees_both_sides(tiny_models, tmp_path):
    c = LocalCluster(
        tiny_models["kimi_linear"],
        [WorkerSpec("prefill", ["--max-num-batched-tokens", "8"]), WorkerSpec("decode")],
        log_dir=tmp_path / "logs",
    )
    c.start()
    try:
        p, d = c.worker("prefill"), c.worker("decode")

        async def run():
            async with grpc.aio.insecure_channel(d.endpoint) as ch:
                call = decode_pb2_grpc.DecodeStub(ch).Generate(
                    _decode_request(random_prompts(1, [1500], seed=23)[0], p.endpoint, "cancel-me")
                )
                deadline = time.monotonic() + 10
                while scrape(p.metrics_port)["tandem_prefill_live_transfers"] < 1:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
                call.cancel()

        asyncio.run(run())
        ok, used, took = wait_all_free(c, 1.0)
        assert ok, f"still in use after {took:.2f} s: {used}"
    finally:
        c.stop()
