"""gRPC channel options vs the handoff transport's throughput, against a raw TCP copy of the same bytes.

    python -m bench.handoff_options [--total-mib 256] [--repeats 3]

The handoff bench (bench/handoff.py) found gRPC's Python receive path, not the network or our code, to be
the limit of one receiving process (55-67 % of one raw socket on a 16-core host, with or without lanes).
This sweeps the client-side knobs that change how gRPC reads: TCP read chunk sizes, HTTP/2 frame size, flow
control. The sender is bench/handoff.py's (the real server registration and SERVER_OPTIONS); each variant
drains the Prefill stream as raw message bytes on a fresh connection, 1 MiB messages, best of ``repeats``.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time

from bench import handoff_data as hd
from bench import handoff_io as hb
from tandem.grpc_util import KEEPALIVE_OPTIONS
from tandem.malloc import tune_malloc
from tandem.rpc import prefill_pb2 as pb

MIB = 1 << 20
_READ = [
    ("grpc.experimental.tcp_read_chunk_size", 1 * MIB),
    ("grpc.experimental.tcp_min_read_chunk_size", 256 << 10),
    ("grpc.experimental.tcp_max_read_chunk_size", 4 * MIB),
]
_FRAME = [("grpc.http2.max_frame_size", (1 << 24) - 1)]
_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 64 * MIB)]
VARIANTS = {
    "defaults (as the decode worker)": [],
    "TCP reads of 256 KiB - 4 MiB": _READ,
    "HTTP/2 frames up to 16 MiB": _FRAME,
    "no BDP probe, 64 MiB lookahead": _WINDOW,
    "reads + frames": _READ + _FRAME,
    "reads + frames + window": _READ + _FRAME + _WINDOW,
    "defaults, again (order effects)": [],
}


async def _drain(port: int, options: list, repeats: int, nbytes: int) -> tuple[float, float]:
    import grpc

    opts = [*KEEPALIVE_OPTIONS, ("grpc.use_local_subchannel_pool", 1), *options]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
        stream = ch.unary_stream("/tandem.v1.Prefill/Prefill", request_serializer=pb.PrefillRequest.SerializeToString)
        req = pb.PrefillRequest(request_id="r", max_message_bytes=MIB)
        async for _ in stream(req):  # warm-up
            pass
        best_s, best_cpu = float("inf"), float("inf")
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            async for _ in stream(req):
                pass
            best_s, best_cpu = min(best_s, time.perf_counter() - t0), min(best_cpu, time.process_time() - c0)
    return nbytes / best_s / 1e9, best_cpu / (nbytes / 1e9)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total-mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    tune_malloc()
    cfg = hd.bench_config()
    n = hd.tokens_for(cfg, a.total_mib * MIB)
    total = hd.payload_bytes(cfg, n)
    raw_p, raw_port = hb._start(hb._raw_sender, total)
    grpc_p, grpc_port = hb._start(hb._grpc_sender, n)
    try:
        sock = socket.create_connection(("127.0.0.1", raw_port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(total)
        hb.raw_receive([sock], buf, raw_p.pid)
        raw = total / min(hb.raw_receive([sock], buf, raw_p.pid).seconds for _ in range(a.repeats)) / 1e9
        print(f"{total / MIB:.0f} MiB, 1 MiB messages; raw TCP {raw:.2f} GB/s\n")
        print("| client options | GB/s | vs raw TCP | receiver CPU s/GB |\n|---|---|---|---|")
        for name, opts in VARIANTS.items():
            gbps, cpu = asyncio.run(_drain(grpc_port, opts, a.repeats, total))
            print(f"| {name} | {gbps:.2f} | {100 * gbps / raw:.0f} % | {cpu:.2f} |", flush=True)
        sock.close()
    finally:
        for proc in (raw_p, grpc_p):
            proc.terminate()
            proc.join(10)


if __name__ == "__main__":
    main()
