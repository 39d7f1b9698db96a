"""KV handoff throughput on loopback: the decode worker's receive path vs a raw TCP copy of the same bytes.

python -m bench.handoff [--total-mib 256] [--repeats 3] [--max-message-kib 256 1024 4096] [--lanes 1 2 4]

What is sent (bench/handoff_data.py): one long prompt's handoff for a model with Kimi-Linear-48B's cache
shapes (7 MLA layers, 20 KDA layers' state), cut into messages by the real producer
(HandoffProducer.on_layer fed 1024-token prefill chunks), for each max_message_bytes (1 MiB is the prefill
worker's default). A sender process (spawn) serves them on the project's Prefill/Prefill stream with
SERVER_OPTIONS; they are built before the clock starts, as the producer builds them on the prefill engine
thread during the forward (that cost is the breakdown's "producer encode").

Receivers, in this process, interleaved repeat by repeat so they see the same load:

- raw TCP: the sender ``sendall``s as many bytes as the handoff's payload; ``recv_into`` a preallocated bytearray.
- gRPC, decode worker path: exactly DecodeService._pull's: ``wire.prefill_call`` on ``grpc_util.channel``,
  each message into ``HandoffConsumer.accept`` (CRC-32 verified, then written into the reserved pages of a
  CacheTensors at scattered page ids), ending with its completeness checks.
- gRPC, transport only: the same stream as raw message bytes, nothing parsed (the floor under that path).
- gRPC, transport only, sync API: the same with grpc's blocking API, each stream drained on a thread of
  its own (whether the asyncio receive path is what limits the transport).

With ``--lanes``, each gRPC path also runs with the handoff dealt over that many streams (the Prefill stream +
PullLane, engine/kv_transfer/lanes.py), each on its own connection, as a decode worker started with
``--handoff-lanes N`` pulls it (``decode_svc.pull.pull_handoff``); and raw TCP over as many sockets, for
reference. The ratio column is always against the single raw socket.

Every transfer also records the CPU seconds of both processes. The breakdown times each receiver step alone,
as CPU seconds per GB of payload.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import resource
import socket
import statistics
import struct
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from bench import handoff_data as hd
from decode_svc.pull import pull_handoff
from engine.kv_transfer.wire import EncodedChunk, add_prefill_servicer, lane_pull_call, parse_chunk, prefill_call
from tandem.grpc_util import KEEPALIVE_OPTIONS, SERVER_OPTIONS, channel, own_connection_channel
from tandem.malloc import tune_malloc

MIB = 1 << 20
SEED = 0
RAW, DECODE, TRANSPORT = "raw TCP", "gRPC, decode worker path", "gRPC, transport only"
TRANSPORT_SYNC = "gRPC, transport only, sync API, a thread per stream"


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

    from tandem.rpc import prefill_pb2_grpc

    cfg = hd.bench_config()
    cache = hd.make_cache(cfg, -(-num_tokens // hd.PAGE_SIZE), SEED)

    class Servicer(prefill_pb2_grpc.PrefillServicer):
        key, streams = None, []

        async def Prefill(self, request, context):
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
        if mode == "prepare":
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
            else:  # exactly the decode worker's pull (DecodeService._pull)
                consumer = hd.consumer_for(self.cfg, self.cache, self.n, self.page_ids, lanes)
                await pull_handoff(self.call(req), consumer, None, rid, None, self.lane_call)
        return c.sample

    async def close(self) -> None:
        for ch in [self.channel, *self.lane_channels.values()]:
            await ch.close()
        for ch in self.sync_channels.values():
            ch.close()


def _summary(samples: list[Sample], nbytes: int) -> dict[str, float]:
    times = [s.seconds for s in samples]
    return {
        "best_gbps": nbytes / min(times) / 1e9,
        "median_gbps": nbytes / statistics.median(times) / 1e9,
        "rx_cpu_s_per_gb": statistics.median(s.rx_cpu for s in samples) / (nbytes / 1e9),
        "tx_cpu_s_per_gb": statistics.median(s.tx_cpu for s in samples) / (nbytes / 1e9),
        "rx_faults_per_mib": statistics.median(s.rx_faults for s in samples) / (nbytes / MIB),
    }


async def _bench_async(
    raw_port: int, raw_pid: int, grpc_port: int, grpc_pid: int, num_tokens: int, sizes, lanes_list, repeats
):
    cfg = hd.bench_config()
    total = hd.payload_bytes(cfg, num_tokens)
    socks = []
    for _ in range(max(lanes_list)):
        sock = socket.create_connection(("127.0.0.1", raw_port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks.append(sock)
    buf = bytearray(total)
    for lanes in lanes_list:
        raw_receive(socks[:lanes], buf, raw_pid)  # warm-up
    rx = GrpcReceiver(f"127.0.0.1:{grpc_port}", num_tokens, grpc_pid)
    expected = hd.make_cache(cfg, -(-num_tokens // hd.PAGE_SIZE), SEED)
    out = {}
    for m in sizes:
        for lanes in lanes_list:
            await rx.receive(m, "prepare", "prepare", lanes)
            await rx.receive(m, "warm-up", DECODE, lanes)
            if not hd.same_contents(expected, rx.cache, num_tokens, rx.page_ids):
                raise RuntimeError(f"{m} B messages, {lanes} lanes: the received cache differs from the sender's")
            samples: dict[str, list[Sample]] = {
                RAW: [],
                DECODE: [],
                TRANSPORT: [],
                TRANSPORT_SYNC: [],
            }
            for i in range(repeats):
                samples[RAW].append(raw_receive(socks[:lanes], buf, raw_pid))
                for mode in (DECODE, TRANSPORT, TRANSPORT_SYNC):
                    samples[mode].append(await rx.receive(m, f"r{i}", mode, lanes))
            for k, v in samples.items():
                out[(m, lanes, k)] = _summary(v, total)
    for sock in socks:
        sock.close()
    await rx.close()
    return out


def bench_transfers(num_tokens: int, sizes: list[int], lanes_list: list[int], repeats: int) -> dict:
    """(max message bytes, lanes, RAW | DECODE | TRANSPORT) -> throughput and CPU summary."""
    total = hd.payload_bytes(hd.bench_config(), num_tokens)
    raw_p, raw_port = _start(_raw_sender, total)
    try:
        grpc_p, grpc_port = _start(_grpc_sender, num_tokens)
        try:
            return asyncio.run(
                _bench_async(raw_port, raw_p.pid, grpc_port, grpc_p.pid, num_tokens, sizes, lanes_list, repeats)
            )
        finally:
            grpc_p.terminate()
            grpc_p.join(10)
    finally:
        raw_p.terminate()
        raw_p.join(10)


# ---- breakdown: each step alone --------------------------------------------------------------------


def _cpu_per_gb(fn: Callable[[], object], nbytes: int, min_s: float = 0.3) -> float:
    """CPU seconds per GB of fn (which handles nbytes per call), best of a few timed batches."""
    fn()
    n, best = 1, float("inf")
    while True:
        t0 = time.process_time()
        for _ in range(n):
            fn()
        dt = time.process_time() - t0
        best = min(best, dt / n)
        if dt >= min_s:
            break
        n *= 2
    return best / (nbytes / 1e9)


def breakdown(num_tokens: int, max_bytes: int) -> dict[str, float]:
    """CPU s/GB of each step on the messages of one handoff, in one thread, no network."""
    from engine.kv_transfer.codec import crc32

    cfg = hd.bench_config()
    pages = -(-num_tokens // hd.PAGE_SIZE)
    src = hd.make_cache(cfg, pages, SEED)
    msgs = hd.produce(cfg, src, num_tokens, max_bytes)
    total = hd.payload_bytes(cfg, num_tokens)
    wires = [hd.wire_bytes(m) for m in msgs]
    received = [parse_chunk(w) for w in wires]
    datas = [r.data for r in received if hasattr(r, "data")]
    dst = hd.make_cache(cfg, 2 * pages, None)
    page_ids = random.Random(SEED).sample(range(2 * pages), pages)

    def accept_all(items: list) -> Callable[[], None]:
        def run() -> None:
            c = hd.consumer_for(cfg, dst, num_tokens, page_ids)
            for x in items:
                c.accept(x)

        return run

    def each(fn: Callable[[object], object], items: list) -> Callable[[], None]:
        return lambda: [fn(x) for x in items]

    from tandem.rpc import prefill_pb2 as pb

    pb_parse = pb.HandoffChunk.FromString  # the generated stub's deserializer
    return {
        "producer encode": _cpu_per_gb(lambda: hd.produce(cfg, src, num_tokens, max_bytes), total),
        "parse_chunk": _cpu_per_gb(each(parse_chunk, wires), total),
        "crc32 (zlib-ng)": _cpu_per_gb(each(crc32, datas), total),
        "crc32 (system zlib)": _cpu_per_gb(each(zlib.crc32, datas), total),
        "accept": _cpu_per_gb(accept_all(received), total),
        "parse_chunk + accept": _cpu_per_gb(lambda: accept_all([parse_chunk(w) for w in wires])(), total),
        "protobuf parse + accept": _cpu_per_gb(lambda: accept_all([pb_parse(w) for w in wires])(), total),
    }


# ---- main ----------------------------------------------------------------------------------------


def _size(m: int) -> str:
    return f"{m // MIB} MiB" if m % MIB == 0 else f"{m >> 10} KiB"


def message_sizes(num_tokens: int, max_bytes: int) -> str:
    """The distinct payload sizes of the producer's messages (most frequent first), for the table."""
    cfg = hd.bench_config()
    msgs = hd.produce(cfg, hd.make_cache(cfg, -(-num_tokens // hd.PAGE_SIZE), None), num_tokens, max_bytes)
    sizes = [m.payload_bytes for m in msgs if isinstance(m, EncodedChunk)]
    counts = {s: sizes.count(s) for s in set(sizes)}
    top = sorted(counts, key=lambda s: -counts[s])[:3]
    return f"{len(sizes)} msgs: " + ", ".join(f"{counts[s]} x {s / 1024:.0f} KiB" for s in top)


def run_handoff_bench(
    total_mib: int = 256, repeats: int = 3, sizes: list[int] | None = None, lanes_list: list[int] | None = None
) -> dict:
    import google.protobuf
    import grpc

    torch.set_num_threads(1)  # as the sender process; the receive path runs no torch kernels on the CPU
    tune_malloc()  # as a decode worker (tandem/worker.py)
    sizes = list(sizes or (256 << 10, 1 * MIB, 4 * MIB))
    lanes_list = list(lanes_list or (1,))
    cfg = hd.bench_config()
    n = hd.tokens_for(cfg, total_mib * MIB)
    total = hd.payload_bytes(cfg, n)
    print(
        f"handoff bench: {n}-token prompt, {total / MIB:.0f} MiB of KV + state, best / median of {repeats} "
        f"(interleaved), 127.0.0.1, {os.cpu_count()} cores, torch {torch.__version__}, grpcio {grpc.__version__}, "
        f"protobuf {google.protobuf.__version__}, load average {os.getloadavg()[0]:.1f} at start\n",
        flush=True,
    )
    res = bench_transfers(n, sizes, lanes_list, repeats)
    print(
        "| max_message_bytes | messages | lanes | path | GB/s best / median | vs one raw socket (medians) "
        "| receiver CPU s/GB | sender CPU s/GB | receiver page faults/MiB |\n" + "|---" * 9 + "|"
    )
    for m in sizes:
        raw = res[(m, 1, RAW)]
        for lanes in lanes_list:
            for k in (RAW, DECODE, TRANSPORT, TRANSPORT_SYNC):
                r = res[(m, lanes, k)]
                ratio = "-" if (k, lanes) == (RAW, 1) else f"{100 * r['median_gbps'] / raw['median_gbps']:.0f} %"
                what = message_sizes(n, m) if (k, lanes) == (RAW, lanes_list[0]) else ""
                path = k if k != RAW or lanes == 1 else f"raw TCP, {lanes} sockets"
                print(
                    f"| {_size(m)} | {what} | {lanes} | {path} | {r['best_gbps']:.2f} / {r['median_gbps']:.2f} "
                    f"| {ratio} | {r['rx_cpu_s_per_gb']:.2f} | {r['tx_cpu_s_per_gb']:.2f} "
                    f"| {r['rx_faults_per_mib']:.0f} |",
                    flush=True,
                )
    bd_tokens = min(n, 4 * hd.PREFILL_CHUNK)
    print(f"\nEach step alone, CPU s/GB of payload ({bd_tokens}-token handoff, one thread, no network):\n")
    bd = {m: breakdown(bd_tokens, m) for m in sizes}
    steps = list(next(iter(bd.values())))
    print("| max_message_bytes | " + " | ".join(steps) + " |\n|---|" + "---|" * len(steps))
    for m in sizes:
        print(f"| {_size(m)} | " + " | ".join(f"{bd[m][s]:.3f}" for s in steps) + " |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end", flush=True)
    return {"transfers": res, "breakdown": bd}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total-mib", type=int, default=256, help="handoff size (rounded to whole prefill chunks)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-message-kib", type=int, nargs="+", default=None, help="producer max_message_bytes (KiB)")
    p.add_argument("--lanes", type=int, nargs="+", default=[1], help="streams per handoff (1 must come first)")
    a = p.parse_args(argv)
    if a.lanes[0] != 1:
        p.error("--lanes must start with 1: the ratios are against one raw socket")
    sizes = [s << 10 for s in a.max_message_kib] if a.max_message_kib else None
    run_handoff_bench(a.total_mib, a.repeats, sizes, a.lanes)


if __name__ == "__main__":
    main()
