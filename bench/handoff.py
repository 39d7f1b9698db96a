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
- socket lanes, decode worker path: the same pull with ``socket_lanes`` (decode ``--handoff-transport socket``):
  the Prefill stream carries the control messages, every kv / state message goes over ``lanes`` sockets of
  the sender's socket data plane (engine/kv_transfer/socket_lanes.py: the real server, the real client).

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
import os
import random
import socket
import statistics
import time
import zlib
from collections.abc import Callable

import torch

from bench import handoff_data as hd
from bench.handoff_io import (
    DECODE,
    MIB,
    RAW,
    SEED,
    SOCKET,
    TRANSPORT,
    TRANSPORT_SYNC,
    GrpcReceiver,
    Sample,
    _grpc_sender,
    _raw_sender,
    _start,
    raw_receive,
)
from engine.kv_transfer.wire import EncodedChunk, parse_chunk
from tandem.malloc import tune_malloc

# senders and receivers: bench/handoff_io.py


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
            await rx.receive(m, "prepare", "prepare socket", lanes)
            for mode in (DECODE, SOCKET):
                for pool in (*rx.cache.kv.values(), *rx.cache.recurrent.values(), *rx.cache.conv.values()):
                    pool.zero_()
                await rx.receive(m, f"warm-up {mode}", mode, lanes)
                if not hd.same_contents(expected, rx.cache, num_tokens, rx.page_ids):
                    raise RuntimeError(f"{mode}, {m} B messages, {lanes} lanes: the received cache differs")
            samples: dict[str, list[Sample]] = {
                RAW: [],
                DECODE: [],
                TRANSPORT: [],
                TRANSPORT_SYNC: [],
                SOCKET: [],
            }
            for i in range(repeats):
                samples[RAW].append(raw_receive(socks[:lanes], buf, raw_pid))
                for mode in (DECODE, TRANSPORT, TRANSPORT_SYNC, SOCKET):
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
            for k in (RAW, DECODE, TRANSPORT, TRANSPORT_SYNC, SOCKET):
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
