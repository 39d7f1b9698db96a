"""The two ends of bench/handoff.py's transfers: sender processes (raw TCP, the Prefill / PullLane streams)
and the receivers in the benchmark's process (raw sockets; the decode worker's pull; the transport alone),
each timed with both processes' CPU seconds."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import resource
import socket
import struct
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from bench import handoff_data as hd
from decode_svc.pull import pull_handoff
from engine.kv_transfer.wire import EncodedChunk, add_prefill_servicer, lane_pull_call, prefill_call
from tandem.grpc_util import KEEPALIVE_OPTIONS, SERVER_OPTIONS, channel, own_connection_channel
from tandem.malloc import tune_malloc

MIB = 1 << 20
SEED = 0
RAW, DECODE, TRANSPORT = "raw TCP", "gRPC, decode worker path", "gRPC, transport only"
TRANSPORT_SYNC = "gRPC, transport only, sync API, a thread per stream"
SOCKET = "socket lanes, decode worker path"


# ---- senders (separate processes) ----------------------------------------------------------------


def _raw_sender(port_q, total: int) -> None:
    import threading

    torch.set_num_threads(1)
    data = memoryview(os.urandom(total))
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    while True:  # one thread per connection: the receiver opens one per lane
        conn, _ = srv.accept()
        threading.Thread(target=_raw_serve, args=(conn, data), daemon=True).start()


def _raw_serve(conn: socket.socket, data: memoryview) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    hdr = bytearray(8)
    while True:
        got = 0
        while got < 8:
            n = conn.recv_into(memoryview(hdr)[got:])
            if n == 0:
                return
            got += n
        (want,) = struct.unpack("<Q", hdr)
        conn.sendall(data[:want])


def _grpc_sender(port_q, num_tokens: int) -> None:
    torch.set_num_threads(1)
    tune_malloc()  # as a prefill worker (tandem/worker.py)
    asyncio.run(_grpc_serve(port_q, num_tokens))


async def _grpc_serve(port_q, num_tokens: int) -> None:
    import grpc

    from engine.kv_transfer.lanes import MAX_LANES, HandoffLanes
    from engine.kv_transfer.socket_lanes import serve_socket_lanes
    from engine.kv_transfer.wire import StreamCount
    from tandem.rpc import prefill_pb2 as pb
    from tandem.rpc import prefill_pb2_grpc

    cfg = hd.bench_config()
    cache = hd.make_cache(cfg, -(-num_tokens // hd.PAGE_SIZE), SEED)
    registry = HandoffLanes(MAX_LANES, ttl_s=600)  # the socket data plane, as a prefill worker runs it
    data_server = await serve_socket_lanes(registry, "127.0.0.1", 0)
    data_endpoint = f"127.0.0.1:{data_server.sockets[0].getsockname()[1]}"

    class Servicer(prefill_pb2_grpc.PrefillServicer):
        key, streams, msgs = None, [], {}

        async def Prefill(self, request, context):
            if request.socket_lanes:  # every kv / state message to socket lanes 1..; control stays here
                m = request.max_message_bytes
                if m not in self.msgs:
                    self.msgs = {m: hd.produce(cfg, cache, num_tokens, m)}
                if request.request_id == "prepare":
                    return
                msgs, lanes, count = self.msgs[m], max(2, request.lanes), StreamCount()
                deliver = registry.open(request.request_id, lanes, lambda c: None, skip_lane0=True)
                header = pb.HandoffChunk()
                header.CopyFrom(msgs[0])
                header.header.lanes, header.header.data_endpoint = lanes, data_endpoint
                yield count.sent(header)
                for m in msgs[1:-1]:
                    if isinstance(m, EncodedChunk):
                        deliver(m)
                await asyncio.sleep(0)  # the dealer's hops onto this loop run before the lanes' end
                registry.end(request.request_id)
                for m in msgs[1:-1]:
                    if not isinstance(m, EncodedChunk):
                        yield count.sent(m)
                yield count.end()
                return
            key = (request.max_message_bytes, max(1, request.lanes))
            if key != self.key:  # built outside the receiver's clock: it sends "prepare" first
                self.streams = []
                self.streams = hd.deal(hd.produce(cfg, cache, num_tokens, key[0]), key[1])
                self.key = key
            if request.request_id != "prepare":
                for msg in self.streams[0]:
                    yield msg.wire if isinstance(msg, EncodedChunk) else msg

        async def PullLane(self, request, context):
            for msg in self.streams[request.lane]:
                yield msg.wire if isinstance(msg, EncodedChunk) else msg

    server = grpc.aio.server(options=SERVER_OPTIONS)
    add_prefill_servicer(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_q.put(port)
    await server.wait_for_termination()


def _start(target: Callable, *args) -> tuple[mp.Process, int]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(q, *args), daemon=True)
    p.start()
    return p, q.get(timeout=300)


# ---- receivers (this process) --------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) of another process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


@dataclass
class Sample:
    seconds: float
    rx_cpu: float  # receiver process CPU seconds during the transfer
    tx_cpu: float  # sender process CPU seconds during the transfer
    rx_faults: int  # receiver minor page faults during the transfer


class Clock:
    def __init__(self, sender_pid: int) -> None:
        self.pid = sender_pid

    def __enter__(self) -> Clock:
        self.f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self.t0, self.rx0, self.tx0 = time.perf_counter(), time.process_time(), _proc_cpu(self.pid)
        return self

    def __exit__(self, *exc: object) -> None:
        self.sample = Sample(
            time.perf_counter() - self.t0,
            time.process_time() - self.rx0,
            _proc_cpu(self.pid) - self.tx0,
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.f0,
        )


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    sock.sendall(struct.pack("<Q", len(view)))
    got, total = 0, len(view)
    while got < total:
        n = sock.recv_into(view[got:], min(total - got, 4 * MIB))
        if n == 0:
            raise ConnectionError("raw sender closed the connection")
        got += n


def raw_receive(socks: list[socket.socket], buf: bytearray, sender_pid: int) -> Sample:
    """The payload's bytes over len(socks) sockets at once (a thread each: recv_into releases the GIL)."""
    view, total = memoryview(buf), len(buf)
    cut = [total * i // len(socks) for i in range(len(socks) + 1)]
    with Clock(sender_pid) as c:
        if len(socks) == 1:
            _recv_exact(socks[0], view)
        else:
            with ThreadPoolExecutor(len(socks)) as pool:
                list(pool.map(lambda i: _recv_exact(socks[i], view[cut[i] : cut[i + 1]]), range(len(socks))))
    return c.sample


class GrpcReceiver:
    """The decode worker's pull of one handoff into reserved pages (a fresh consumer per transfer)."""

    def __init__(self, endpoint: str, num_tokens: int, sender_pid: int) -> None:
        import grpc

        from tandem.rpc import prefill_pb2 as pb

        self.pb, self.pid, self.n = pb, sender_pid, num_tokens
        self.cfg = hd.bench_config()
        pages = -(-num_tokens // hd.PAGE_SIZE)
        self.cache = hd.make_cache(self.cfg, 2 * pages, None)
        self.page_ids = random.Random(SEED).sample(range(2 * pages), pages)  # scattered, as after some churn
        self.endpoint = endpoint
        self.channel = channel(endpoint)
        self.call = prefill_call(self.channel)
        self.transport = self.channel.unary_stream(
            "/tandem.v1.Prefill/Prefill", request_serializer=pb.PrefillRequest.SerializeToString
        )
        self.lane_channels: dict[int, object] = {}  # lane -> its own connection, kept as a decode worker does
        self.sync_channels: dict[int, object] = {}
        self.grpc = grpc

    def _lane_channel(self, lane: int):
        if lane not in self.lane_channels:
            self.lane_channels[lane] = own_connection_channel(self.endpoint)
        return self.lane_channels[lane]

    def lane_call(self, lane: int):
        return lane_pull_call(self._lane_channel(lane))

    def lane_transport(self, lane: int):
        return self._lane_channel(lane).unary_stream(
            "/tandem.v1.Prefill/PullLane", request_serializer=self.pb.LanePullRequest.SerializeToString
        )

    def _sync_drain(self, lane: int, req) -> None:
        if lane not in self.sync_channels:
            import grpc

            opts = [*KEEPALIVE_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
            self.sync_channels[lane] = grpc.insecure_channel(self.endpoint, options=opts)
        ch = self.sync_channels[lane]
        method, ser = (
            ("/tandem.v1.Prefill/Prefill", self.pb.PrefillRequest.SerializeToString)
            if lane == 0
            else ("/tandem.v1.Prefill/PullLane", self.pb.LanePullRequest.SerializeToString)
        )
        for _ in ch.unary_stream(method, request_serializer=ser)(req):
            pass

    async def receive(self, max_bytes: int, rid: str, mode: str, lanes: int = 1) -> Sample:
        req = self.pb.PrefillRequest(request_id=rid, max_message_bytes=max_bytes, lanes=lanes)
        if mode in (SOCKET, "prepare socket"):  # `lanes` data sockets beside the Prefill stream
            req.lanes, req.socket_lanes = lanes + 1, True
        if mode.startswith("prepare"):
            async for _ in self.transport(req):
                pass
            return Sample(0, 0, 0, 0)

        async def drain(stream) -> None:
            async for _ in stream:
                pass

        with Clock(self.pid) as c:
            if mode == TRANSPORT_SYNC:
                reqs = [req] + [self.pb.LanePullRequest(request_id=rid, lane=i) for i in range(1, lanes)]
                with ThreadPoolExecutor(lanes) as pool:
                    await asyncio.gather(
                        *[asyncio.wrap_future(pool.submit(self._sync_drain, i, r)) for i, r in enumerate(reqs)]
                    )
            elif mode == TRANSPORT:
                lane_reqs = [self.pb.LanePullRequest(request_id=rid, lane=i) for i in range(1, lanes)]
                await asyncio.gather(
                    drain(self.transport(req)), *[drain(self.lane_transport(r.lane)(r)) for r in lane_reqs]
                )
            else:  # exactly the decode worker's pull (DecodeService._pull), over gRPC or socket lanes
                consumer = hd.consumer_for(self.cfg, self.cache, self.n, self.page_ids, max(1, req.lanes))
                await pull_handoff(self.call(req), consumer, None, rid, None, self.lane_call)
        return c.sample

    async def close(self) -> None:
        for ch in [self.channel, *self.lane_channels.values()]:
            await ch.close()
        for ch in self.sync_channels.values():
            ch.close()
