"""Socket lanes (engine/kv_transfer/socket_lanes.py): a handoff whose kv / state messages all go over lanes on
the producer's socket data plane arrives bit-exact, through the real server and client on loopback; refused,
failed, cut and malformed lanes end in clear errors, fast. (Between real processes: tests/e2e/test_pd_lanes.py.)"""

from __future__ import annotations

import asyncio
import socket
import struct

import pytest
import torch

from engine.kv_transfer.codec import HandoffError
from engine.kv_transfer.lanes import Dealer, HandoffLanes
from engine.kv_transfer.socket_lanes import MAX_FRAME, SocketLaneFailed, pull_socket_lane, serve_socket_lanes
from engine.kv_transfer.wire import EncodedChunk, StreamCount
from tandem.rpc import prefill_pb2 as pb
from tests.conftest import make_engine, random_prompts
from tests.test_kv_lanes import _consumer, _is_data
from tests.test_kv_transfer import _handoff

LANES = 3


def _encoded(m: pb.HandoffChunk) -> EncodedChunk:
    kind = m.WhichOneof("payload")
    return EncodedChunk(m.SerializeToString(), kind, len(getattr(m, kind).tensor.data))


@pytest.fixture(scope="module")
def handoff(tiny_models):
    model_dir = tiny_models["kimi_linear"]
    p_engine = make_engine(model_dir)
    prompt = random_prompts(1, [45], seed=9)[0]
    msgs, p_req, fp = _handoff(p_engine, prompt)
    return model_dir, p_engine, p_req, fp, len(prompt), msgs


async def _serve(lanes: HandoffLanes) -> tuple[asyncio.Server, str]:
    server = await serve_socket_lanes(lanes, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_all_data_over_socket_lanes_is_bit_exact(handoff):
    _, p_engine, p_req, _, n, msgs = handoff
    d_engine, res, consumer = _consumer((*handoff[:5], None))

    async def run():
        lanes = HandoffLanes(max_lanes=LANES, ttl_s=5)
        server, endpoint = await _serve(lanes)
        lane0: list[EncodedChunk] = []
        deliver = lanes.open("r", LANES, lane0.append, skip_lane0=True)
        for m in msgs[1:-1]:
            if _is_data(m):
                deliver(_encoded(m))
        await asyncio.sleep(0)  # the dealer's hops onto the loop
        lanes.end("r")
        assert lane0 == []  # the Prefill stream keeps the control messages only
        header = pb.HandoffChunk()
        header.CopyFrom(msgs[0])
        header.header.lanes, header.header.data_endpoint = LANES, endpoint
        count = StreamCount()
        assert consumer.accept(count.sent(header)) is None and consumer.data_endpoint == endpoint
        pulls = [pull_socket_lane(endpoint, "r", i, lambda m, i=i: consumer.accept_lane(i, m)) for i in (1, 2)]
        results = await asyncio.gather(*pulls)
        for m in msgs[1:-1]:
            if not _is_data(m):
                assert consumer.accept(count.sent(m)) is None
        final = consumer.accept(count.end())
        server.close()
        await server.wait_closed()
        assert lanes.live == 0  # both lanes pulled to their end: the registry let go
        return results, final

    results, final = asyncio.run(run())
    assert results == [None, None] and final is not None  # the Prefill stream's end completed it
    for layer, pages in p_engine.cache.kv.items():
        got = d_engine.cache.kv[layer][res.page_ids].flatten(0, 1)[:n]
        assert torch.equal(got, pages[p_req.page_ids].flatten(0, 1)[:n]), layer
    for layer in p_engine.cache.recurrent:
        want = p_engine.cache.recurrent[layer][p_req.slot_ids[0]]
        assert torch.equal(d_engine.cache.recurrent[layer][res.slot_ids[0]], want)


def test_refusals_and_failures_carry_their_codes():
    async def run():
        lanes = HandoffLanes(max_lanes=LANES, ttl_s=5)
        server, endpoint = await _serve(lanes)
        lanes.open("r", LANES, lambda c: None, skip_lane0=True)
        codes = []
        for rid, lane in (("unknown", 1), ("r", 5)):
            with pytest.raises(SocketLaneFailed) as e:
                await pull_socket_lane(endpoint, rid, lane, lambda m: None)
            codes.append(e.value.code)
        pulling = asyncio.create_task(pull_socket_lane(endpoint, "r", 1, lambda m: None))
        await asyncio.sleep(0.1)
        with pytest.raises(SocketLaneFailed) as again:
            await pull_socket_lane(endpoint, "r", 1, lambda m: None)
        lanes.fail("r", "its consumer went away")
        with pytest.raises(SocketLaneFailed) as failed:
            await asyncio.wait_for(pulling, 2)
        server.close()
        await server.wait_closed()
        return codes, again.value, failed.value

    codes, again, failed = asyncio.run(run())
    assert codes == ["NOT_FOUND", "INVALID_ARGUMENT"]
    assert again.code == "FAILED_PRECONDITION" and "already pulled" in str(again)
    assert failed.code == "ABORTED" and "its consumer went away" in str(failed)


def _one_shot_server(reply: bytes) -> tuple[socket.socket, str]:
    """A peer that reads the lane request, sends ``reply`` and closes (a producer that died mid-lane)."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = srv.accept()
        n = struct.unpack("<I", conn.recv(4))[0]
        conn.recv(n)
        conn.sendall(reply)
        conn.close()

    import threading

    threading.Thread(target=serve, daemon=True).start()
    return srv, f"127.0.0.1:{srv.getsockname()[1]}"


@pytest.mark.parametrize(
    ("reply", "error", "match"),
    [
        (struct.pack("<I", 100) + b"x" * 10, SocketLaneFailed, "closed the connection mid-lane"),
        (struct.pack("<I", MAX_FRAME + 1), HandoffError, "a frame of"),
        (b"", SocketLaneFailed, "closed the connection mid-lane"),
        (struct.pack("<I", 8) + b"\xff" * 8, HandoffError, "a message could not be decoded"),
    ],
    ids=["cut mid-frame", "oversized frame", "closed at once", "not a message"],
)
def test_a_cut_or_malformed_lane_is_an_error_at_once(reply, error, match):
    srv, endpoint = _one_shot_server(reply)
    try:
        with pytest.raises(error, match=match):
            asyncio.run(asyncio.wait_for(pull_socket_lane(endpoint, "r", 1, lambda m: None), 2))
    finally:
        srv.close()


def test_nobody_listening_is_unavailable():
    with socket.create_server(("127.0.0.1", 0)) as s:
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(SocketLaneFailed) as e:
        asyncio.run(pull_socket_lane(endpoint, "r", 1, lambda m: None))
    assert e.value.code == "UNAVAILABLE" and "cannot connect" in str(e.value)


def test_a_malformed_request_gets_an_error_frame():
    async def run():
        server, endpoint = await _serve(HandoffLanes(max_lanes=LANES, ttl_s=5))
        host, port = endpoint.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(struct.pack("<I", 1 << 20))  # a request far over its size limit
        await writer.drain()
        n = struct.unpack("<I", await reader.readexactly(4))[0]
        body = await reader.readexactly(n & ~(1 << 31))
        writer.close()
        server.close()
        await server.wait_closed()
        return n >> 31, body.decode()

    flag, body = asyncio.run(run())
    assert flag == 1 and body.startswith("INVALID_ARGUMENT: a lane request of")


def test_skip_lane0_deals_every_message_to_lanes_1_on():
    loop = asyncio.new_event_loop()
    try:
        got0: list = []
        queues = [asyncio.Queue(), asyncio.Queue()]
        deal = Dealer(loop, got0.append, queues, skip_lane0=True)
        for k in range(5):
            deal(k)
        loop.run_until_complete(asyncio.sleep(0))
        assert got0 == [] and [queues[0].get_nowait() for _ in range(3)] == [0, 2, 4]
        assert [queues[1].get_nowait() for _ in range(2)] == [1, 3]
    finally:
        loop.close()


def test_consumer_refuses_a_data_endpoint_without_a_lane(handoff):
    _, _, consumer = _consumer((*handoff[:5], None))
    header = pb.HandoffChunk()
    header.CopyFrom(handoff[-1][0])
    header.header.data_endpoint = "127.0.0.1:1"
    with pytest.raises(HandoffError, match="no lane to pull from it"):
        consumer.accept(header)


def test_a_consumer_gone_mid_lane_ends_the_lane_on_the_producer():
    """The producer notices a closed socket at its next write: the lane ends as cancelled, nothing hangs."""

    async def run():
        lanes, outcomes = HandoffLanes(max_lanes=2, ttl_s=5), []
        server = await serve_socket_lanes(lanes, "127.0.0.1", 0, lambda outcome, n: outcomes.append(outcome))
        port = server.sockets[0].getsockname()[1]
        deliver = lanes.open("r", 2, lambda c: None, skip_lane0=True)
        for _ in range(64):  # 64 MiB: far more than the socket buffers hold
            deliver(EncodedChunk(b"\0" * (1 << 20), "kv", 1 << 20))
        await asyncio.sleep(0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        req = pb.LanePullRequest(request_id="r", lane=1).SerializeToString()
        writer.write(struct.pack("<I", len(req)) + req)
        await reader.readexactly(4 + (1 << 20))  # one message, then the consumer goes away
        writer.transport.abort()
        deadline = asyncio.get_running_loop().time() + 2
        while not outcomes and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        live = lanes.live  # the lane was pulled and ended: the registry holds nothing of this handoff
        server.close()
        await server.wait_closed()
        return outcomes, live

    assert asyncio.run(run()) == (["cancelled"], 0)


def test_a_silent_connection_is_closed(monkeypatch):
    """A peer that connects and never asks for a lane is dropped after REQUEST_TIMEOUT_S."""
    import engine.kv_transfer.socket_lanes as sl

    monkeypatch.setattr(sl, "REQUEST_TIMEOUT_S", 0.2)

    async def run():
        outcomes = []
        server = await serve_socket_lanes(HandoffLanes(2, 5), "127.0.0.1", 0, lambda o, n: outcomes.append(o))
        reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        closed = await asyncio.wait_for(reader.read(), 2)  # EOF once the server gives up
        writer.close()
        server.close()
        await server.wait_closed()
        return closed, outcomes

    assert asyncio.run(run()) == (b"", ["cancelled"])


@pytest.mark.parametrize(
    ("bind", "advertise", "want"),
    [
        ("127.0.0.1", None, "127.0.0.1:7"),
        ("::1", None, "[::1]:7"),
        ("0.0.0.0", None, None),
        ("::", None, None),
        ("0.0.0.0", "10.1.2.3", "10.1.2.3:7"),
        ("0.0.0.0", "fd00::5", "[fd00::5]:7"),
    ],
)
def test_advertised_endpoint(bind, advertise, want):
    """--advertise-host wins; else a wildcard bind is advertised by this host's name (peers on other hosts
    dial it), an address as is."""
    from tandem.grpc_util import advertised_endpoint

    assert advertised_endpoint(bind, 7, advertise) == (want or f"{socket.gethostname()}:7")


@pytest.mark.parametrize(
    ("argv", "data_port", "transport"),
    [
        ([], 0, "socket"),
        (["--handoff-data-port", "off", "--handoff-transport", "grpc"], None, "grpc"),
        (["--handoff-data-port", "7001"], 7001, "socket"),
    ],
)
def test_socket_lanes_are_the_default_data_plane(argv, data_port, transport):
    """Workers started with no flags serve (prefill) and ask for (decode) socket lanes; `off` / `grpc` opt out."""
    from decode_svc.config import DecodeConfig
    from engine.config import EngineConfig
    from prefill_svc.config import PrefillConfig
    from tandem.cli import build_parser

    for role in ("prefill", "decode"):
        a = build_parser().parse_args([role, *argv])
        assert (a.handoff_data_port, a.handoff_transport) == (data_port, transport)
    assert PrefillConfig(EngineConfig(model="m")).data_port == 0
    assert DecodeConfig(EngineConfig(model="m")).handoff_transport == "socket"


def test_a_bad_data_port_flag_names_the_value(capsys):
    from tandem.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["prefill", "--handoff-data-port", "auto"])
    assert "'auto' is neither a port number nor 'off'" in capsys.readouterr().err


def _lane_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("socket lane")]


def test_a_cancelled_pull_ends_its_threads_and_the_lane(handoff):
    """Cancelling a pull mid-lane (the decode request went away) shuts the socket: the lane's receiving and
    placing threads end, the producer sees the lane cancelled, and nothing is taken after the cancel."""

    async def run():
        lanes, outcomes, taken = HandoffLanes(max_lanes=2, ttl_s=5), [], []
        server = await serve_socket_lanes(lanes, "127.0.0.1", 0, lambda outcome, n: outcomes.append(outcome))
        endpoint = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        deliver = lanes.open("r", 2, lambda c: None, skip_lane0=True)
        data = [_encoded(m) for m in handoff[-1] if _is_data(m)]
        for m in data[:3]:  # then the producer has nothing more for a while (a long prefill)
            deliver(m)
        pulling = asyncio.create_task(pull_socket_lane(endpoint, "r", 1, taken.append))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while len(taken) < 3 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        running = _lane_threads()
        pulling.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pulling
        deliver(data[3])  # sent into a closed connection, never taken
        deadline = loop.time() + 2
        while (_lane_threads() or not outcomes) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        server.close()
        await server.wait_closed()
        return len(taken), running, _lane_threads(), outcomes, lanes.live

    n, running, left, outcomes, live = asyncio.run(run())
    assert n == 3 and len(running) == 2  # a receiving and a placing thread while the lane ran
    assert left == [] and outcomes == ["cancelled"] and live == 0


def test_a_closed_consumer_takes_nothing_more(handoff):
    """``close()`` (the decode worker abandons the handoff, before it frees the reservation): every later
    message is refused, on the prefill stream and on lanes, and no byte lands in the pages."""
    _, _, _, _, _, msgs = handoff
    d_engine, res, consumer = _consumer((*handoff[:5], None))
    header = pb.HandoffChunk()
    header.CopyFrom(msgs[0])
    header.header.lanes = 2
    consumer.accept(header)
    before = {layer: kv[res.page_ids].clone() for layer, kv in d_engine.cache.kv.items()}
    consumer.close()
    data = [m for m in msgs if _is_data(m)]
    with pytest.raises(HandoffError, match="closed"):
        consumer.accept_lane(1, data[0])
    with pytest.raises(HandoffError, match="closed"):
        consumer.accept(data[1])
    for layer, kv in d_engine.cache.kv.items():
        assert torch.equal(kv[res.page_ids], before[layer])
