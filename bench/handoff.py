"""KV handoff throughput on loopback: a gRPC stream of tandem.v1.HandoffChunk vs a raw TCP copy.

python -m bench.handoff [--total-mib 256] [--repeats 3]

One fixed random bfloat16 tensor goes from a sender in its own process (multiprocessing spawn) to a
receiver in this process, over 127.0.0.1:

- raw TCP: ``sendall`` of the tensor's bytes; the receiver ``recv_into`` a preallocated bytearray.
- gRPC: the project's Prefill/Prefill server stream (grpc.aio, the options of ``tandem/grpc_util.py``),
  the tensor cut into HandoffChunk(kv=KVPagePart(tensor=TensorBytes)) messages by the real codec
  (``engine.kv_transfer.codec.tensor_pieces``). Three receivers: "parse + CRC + assemble" verifies
  every piece's CRC and copies it into a preallocated ``TensorAssembler`` as the decode worker's
  consumer does; "parse only" drops the parsed messages; "transport only" takes the raw message
  bytes (no protobuf parse).

Messages are built before the clock starts (the producer builds them in its layer hook, on the
prefill worker's engine thread); that cost is the breakdown's "encode". Each transfer also records
the CPU seconds of both processes and the receiver's minor page faults, so the tables say which
side is the bottleneck even when other work shares the machine. The breakdown times each per-byte
step alone. Then the sweep runs again with glibc malloc tuned (``mallopt``) in both processes, and
so do the gRPC option variants (channel and server options on top of the project's).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import multiprocessing as mp
import os
import resource
import socket
import statistics
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kv_transfer.codec import TensorAssembler, tensor_pieces
from tandem.grpc_util import KEEPALIVE_OPTIONS, SERVER_OPTIONS

KIB, MIB = 1 << 10, 1 << 20
ROW = 512  # bf16 elements per row: tensor shape [total / 1 KiB, 512]
# One page of a real Kimi-Linear MLA layer in bf16: 16 tokens x (kv_lora_rank 512 + rope 64) x 2 B.
# The producer sends one message per (layer, page), so this is the message size production uses.
PAGE_BYTES = 16 * 576 * 2
DEFAULT_SIZES = (PAGE_BYTES, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB)

# Extra channel/server options tried on top of the project's (all exist in the grpcio core).
VARIANTS: dict[str, list[tuple[str, int]]] = {
    "project options": [],
    "+ lookahead 16 MiB": [("grpc.http2.lookahead_bytes", 16 * MIB)],
    "+ max_frame_size 16 MiB": [("grpc.http2.max_frame_size", 16 * MIB - 1)],
    "+ write_buffer 16 MiB": [("grpc.http2.write_buffer_size", 16 * MIB)],
    "+ tcp read chunk 4 MiB": [
        ("grpc.experimental.tcp_read_chunk_size", 4 * MIB),
        ("grpc.experimental.tcp_min_read_chunk_size", 1 * MIB),
        ("grpc.experimental.tcp_max_read_chunk_size", 16 * MIB),
    ],
}
VARIANTS["+ minimal_stack"] = [("grpc.minimal_stack", 1)]
VARIANTS["all of the above"] = [opt for name, opts in VARIANTS.items() if name.startswith("+") for opt in opts]


def make_tensor(total_bytes: int, seed: int = 0) -> torch.Tensor:
    if total_bytes % (2 * ROW):
        raise ValueError(f"total bytes must be a multiple of {2 * ROW}")
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (total_bytes,), dtype=torch.uint8, generator=g)
    return raw.view(torch.bfloat16).reshape(total_bytes // (2 * ROW), ROW)


def build_messages(t: torch.Tensor, max_bytes: int) -> list:
    from tandem.rpc import prefill_pb2 as pb

    return [
        pb.HandoffChunk(kv=pb.KVPagePart(layer=0, page_index=0, num_tokens=t.shape[0], tensor=piece))
        for piece in tensor_pieces(t, max_bytes)
    ]


# glibc malloc settings tried last (see tune_malloc); the same as this environment of a fresh process:
# MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824 MALLOC_ARENA_MAX=1
MALLOC_MMAP_THRESHOLD = 1 << 30
MALLOC_TRIM_THRESHOLD = 1 << 30
MALLOC_ARENA_MAX = 1


def tune_malloc() -> bool:
    """Fixed glibc malloc thresholds and one arena: blocks up to 1 GiB come from the (main) heap and
    freed memory is kept up to 1 GiB, instead of a fresh mmap and munmap / trim per large block (every
    4 KiB page of it then costs a page fault and zeroing when touched). glibc's default threshold
    adapts only up to 32 MiB, and threads other than the main one allocate in arenas that mmap any
    block over 64 MiB. False where glibc is absent."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    return all(
        libc.mallopt(opt, value)
        for opt, value in (
            (m_mmap_threshold, MALLOC_MMAP_THRESHOLD),
            (m_trim_threshold, MALLOC_TRIM_THRESHOLD),
            (m_arena_max, MALLOC_ARENA_MAX),
        )
    )


# ---- senders (separate processes) ----------------------------------------------------------------


def _raw_sender(port_q, total: int, seed: int, malloc_tuned: bool) -> None:
    torch.set_num_threads(1)
    if malloc_tuned:
        tune_malloc()
    data = memoryview(make_tensor(total, seed).view(torch.uint8).reshape(-1).numpy())
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
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


def _grpc_sender(port_q, total: int, seed: int, extra: list[tuple[str, int]], malloc_tuned: bool) -> None:
    torch.set_num_threads(1)
    if malloc_tuned:
        tune_malloc()
    asyncio.run(_grpc_serve(port_q, total, seed, extra))


async def _grpc_serve(port_q, total: int, seed: int, extra: list[tuple[str, int]]) -> None:
    import grpc

    from tandem.rpc import prefill_pb2 as pb
    from tandem.rpc import prefill_pb2_grpc

    t = make_tensor(total, seed)

    class Servicer(prefill_pb2_grpc.PrefillServicer):
        size, msgs = 0, []

        async def Prefill(self, request, context):
            m = request.max_message_bytes
            if m != self.size:  # build (outside the receiver's clock: it sends "prepare" first)
                self.msgs = []
                self.msgs = build_messages(t, m)
                self.size = m
            if request.request_id != "prepare":
                for msg in self.msgs:
                    yield msg
            yield pb.HandoffChunk(end=pb.HandoffEnd(num_messages=len(self.msgs), payload_bytes=total))

    server = grpc.aio.server(options=SERVER_OPTIONS + extra)
    prefill_pb2_grpc.add_PrefillServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_q.put(port)
    await server.wait_for_termination()


@dataclass
class Sender:
    proc: mp.Process
    port: int

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.join(10)


def start_sender(target: Callable, *args) -> Sender:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(q, *args), daemon=True)
    p.start()
    return Sender(p, q.get(timeout=120))


# ---- receivers (this process) --------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) of another process; NaN where /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except OSError:
        return float("nan")


@dataclass
class Sample:
    seconds: float
    rx_cpu: float  # receiver process CPU seconds during the transfer
    tx_cpu: float  # sender process CPU seconds during the transfer
    rx_faults: int  # receiver minor page faults during the transfer


class Clock:
    """Wall time plus the CPU time both processes spent, around one transfer."""

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


def raw_receive(sock: socket.socket, buf: bytearray, sender_pid: int) -> Sample:
    view = memoryview(buf)
    total = len(buf)
    with Clock(sender_pid) as c:
        sock.sendall(struct.pack("<Q", total))
        got = 0
        while got < total:
            n = sock.recv_into(view[got:], min(total - got, 4 * MIB))
            if n == 0:
                raise ConnectionError("raw sender closed the connection")
            got += n
    return c.sample


# receive modes of the gRPC stream
ASSEMBLE = "parse + CRC + assemble"  # what the decode worker's consumer does
PARSE = "parse only"  # protobuf messages, dropped
BYTES = "transport only"  # raw message bytes, no protobuf parse
MODES = (ASSEMBLE, PARSE, BYTES)


async def grpc_receive(
    calls: dict, asm: TensorAssembler, max_bytes: int, rid: str, mode: str, sender_pid: int
) -> Sample:
    """One stream into ``asm`` (preallocated and reused, like the raw receiver's bytearray)."""
    from tandem.rpc import prefill_pb2 as pb

    asm.reset()
    req = pb.PrefillRequest(request_id=rid, max_message_bytes=max_bytes)
    nbytes = 0
    with Clock(sender_pid) as c:
        if mode == BYTES:
            async for raw in calls[BYTES](req):
                nbytes += len(raw)
        else:
            async for msg in calls[ASSEMBLE](req):
                if mode == ASSEMBLE and msg.WhichOneof("payload") == "kv":
                    asm.add(msg.kv.tensor)
                nbytes += 1
    if (mode == ASSEMBLE and not asm.complete) or (mode == BYTES and nbytes < asm.total):
        raise RuntimeError(f"stream {rid} ({mode}) incomplete")
    return c.sample


def _summary(samples: list[Sample], nbytes: int) -> dict[str, float]:
    times = [s.seconds for s in samples]
    return {
        "best_gbps": nbytes / min(times) / 1e9,
        "median_gbps": nbytes / statistics.median(times) / 1e9,
        "median_s": statistics.median(times),
        "rx_cpu_s_per_gb": statistics.median(s.rx_cpu for s in samples) / (nbytes / 1e9),
        "tx_cpu_s_per_gb": statistics.median(s.tx_cpu for s in samples) / (nbytes / 1e9),
        "rx_faults_per_mib": statistics.median(s.rx_faults for s in samples) / (nbytes / MIB),
    }


RAW = "raw TCP"


async def _bench_window_async(
    raw_sender: Sender,
    grpc_sender: Sender,
    t: torch.Tensor,
    sizes: list[int],
    repeats: int,
    extra: list,
    modes: tuple[str, ...],
) -> dict[tuple[int, str], dict[str, float]]:
    import grpc

    from tandem.rpc import prefill_pb2 as pb
    from tandem.rpc import prefill_pb2_grpc

    total = t.numel() * t.element_size()
    expected = t.view(torch.uint8).reshape(-1).numpy().tobytes()
    sock = socket.create_connection(("127.0.0.1", raw_sender.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(total)
    raw_receive(sock, buf, raw_sender.proc.pid)  # warm-up
    if buf != expected:
        raise RuntimeError("raw TCP: received bytes differ from the tensor")
    pid = grpc_sender.proc.pid
    out = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_sender.port}", options=KEEPALIVE_OPTIONS + extra) as ch:
        calls = {
            ASSEMBLE: prefill_pb2_grpc.PrefillStub(ch).Prefill,
            BYTES: ch.unary_stream(
                "/tandem.v1.Prefill/Prefill",
                request_serializer=pb.PrefillRequest.SerializeToString,
                response_deserializer=None,
            ),
        }
        asm = TensorAssembler("handoff bench", t.dtype, tuple(t.shape))
        for m in sizes:
            await grpc_receive(calls, asm, m, "prepare", PARSE, pid)
            asm.buf[:] = bytes(len(asm.buf))
            await grpc_receive(calls, asm, m, "warm-up", ASSEMBLE, pid)
            if asm.buf != expected:
                raise RuntimeError(f"gRPC ({m} B messages): assembled bytes differ from the tensor")
            samples: dict[str, list[Sample]] = {k: [] for k in (RAW, *modes)}
            for i in range(repeats):  # interleaved, so raw and gRPC see the same load on the machine
                samples[RAW].append(raw_receive(sock, buf, raw_sender.proc.pid))
                for mode in modes:
                    samples[mode].append(await grpc_receive(calls, asm, m, f"r{i}", mode, pid))
            for k, v in samples.items():
                out[(m, k)] = _summary(v, total)
    sock.close()
    return out


def bench_window(
    t: torch.Tensor,
    seed: int,
    sizes: list[int],
    repeats: int,
    extra: list,
    modes: tuple[str, ...] = MODES,
    malloc_tuned: bool = False,
) -> dict[tuple[int, str], dict[str, float]]:
    """For each message size: raw TCP and each gRPC receive mode, interleaved repeat by repeat, from
    two sender processes. malloc_tuned applies to the senders; the receiver is this process (call
    tune_malloc() here first). Keys: (message size, RAW or mode)."""
    total = t.numel() * t.element_size()
    raw_sender = start_sender(_raw_sender, total, seed, malloc_tuned)
    try:
        grpc_sender = start_sender(_grpc_sender, total, seed, extra, malloc_tuned)
        try:
            return asyncio.run(_bench_window_async(raw_sender, grpc_sender, t, sizes, repeats, extra, modes))
        finally:
            grpc_sender.stop()
    finally:
        raw_sender.stop()


# ---- breakdown: each per-byte step alone ---------------------------------------------------------


def _rate(fn: Callable[[], object], nbytes: int, min_s: float = 0.2) -> float:
    """Bytes/s of fn (which handles nbytes per call), best of a few timed batches."""
    fn()
    n, best = 1, float("inf")
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        best = min(best, dt / n)
        if dt >= min_s:
            break
        n *= 2
    return nbytes / best


def build_messages_fewer_copies(t: torch.Tensor, max_bytes: int) -> list:
    """Same wire bytes as ``build_messages`` with two copies of the payload (``bytes()`` of a memoryview
    slice, then the field set) instead of up to five (``tobytes()``, the bytes slice, the TensorBytes
    constructor, and one more per enclosing constructor: a submessage passed to a constructor is
    copied). Fills the nested message in place and CRCs the view. A sketch of the producer change
    recommended in docs/PERFORMANCE.md."""
    from engine.kv_transfer.codec import dtype_name
    from tandem.rpc import prefill_pb2 as pb

    mv = memoryview(t.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy())
    total, name, shape, out = len(mv), dtype_name(t.dtype), list(t.shape), []
    for off in range(0, max(total, 1), max_bytes):
        data = mv[off : off + max_bytes]
        msg = pb.HandoffChunk()
        kv = msg.kv
        kv.layer, kv.page_index, kv.num_tokens = 0, 0, t.shape[0]
        tb = kv.tensor
        tb.dtype, tb.offset, tb.total_bytes, tb.crc32 = name, off, total, zlib.crc32(data)
        tb.shape.extend(shape)
        tb.data = bytes(data)
        out.append(msg)
    return out


def breakdown(t: torch.Tensor, sizes: list[int], working_set: int = 64 * MIB) -> dict[int, dict[str, float]]:
    """Each step alone, streaming through ``working_set`` bytes of distinct messages (so memory, not
    cache, bandwidth applies, as in the transfer)."""

    sub = t[: min(working_set, t.numel() * t.element_size()) // (2 * ROW)]
    return {m: _breakdown_one(sub, m) for m in sizes}


def _breakdown_one(sub: torch.Tensor, m: int) -> dict[str, float]:
    from tandem.rpc import prefill_pb2 as pb

    sub_bytes = sub.numel() * sub.element_size()
    msgs = build_messages(sub, m)
    if build_messages_fewer_copies(sub, m)[0].SerializeToString() != msgs[0].SerializeToString():
        raise RuntimeError("build_messages_fewer_copies differs from the codec")
    wires = [x.SerializeToString() for x in msgs]
    pieces = [x.kv.tensor for x in msgs]
    datas = [x.data for x in pieces]
    dest = bytearray(sub_bytes)
    asm = TensorAssembler("x", sub.dtype, tuple(sub.shape))

    def each(fn: Callable[[object], object], items: list) -> Callable[[], None]:
        def run() -> None:
            for x in items:
                fn(x)

        return run

    def copy() -> None:
        o = 0
        for d in datas:
            dest[o : o + len(d)] = d
            o += len(d)

    def add() -> None:
        asm.reset()
        for p in pieces:
            asm.add(p)

    def add_one_read() -> None:  # TensorAssembler.add reading piece.data once, not 4 times (checks omitted)
        for p in pieces:
            d = p.data
            if zlib.crc32(d) != p.crc32:
                raise RuntimeError("crc")
            dest[p.offset : p.offset + len(d)] = d

    return {
        "encode (codec)": _rate(lambda: build_messages(sub, m), sub_bytes),
        "encode, fewer copies": _rate(lambda: build_messages_fewer_copies(sub, m), sub_bytes),
        "serialize": _rate(each(lambda x: x.SerializeToString(), msgs), sub_bytes),
        "parse": _rate(each(pb.HandoffChunk.FromString, wires), sub_bytes),
        "data read": _rate(each(lambda x: x.data, pieces), sub_bytes),
        "crc32": _rate(each(zlib.crc32, datas), sub_bytes),
        "copy": _rate(copy, sub_bytes),
        "assembler.add": _rate(add, sub_bytes),
        "add, data read once": _rate(add_one_read, sub_bytes),
    }


# ---- main ----------------------------------------------------------------------------------------


def _size(m: int) -> str:
    return f"{m // MIB} MiB" if m % MIB == 0 else f"{m // KIB} KiB" if m % KIB == 0 else f"{m / KIB:.0f} KiB"


def _bm(r: dict[str, float]) -> str:
    return f"{r['best_gbps']:.2f} / {r['median_gbps']:.2f}"


_HEAD = (
    "| message | path | GB/s best / median | gRPC / raw (medians) | receiver CPU s/GB | sender CPU s/GB "
    "| receiver page faults/MiB |\n|---|---|---|---|---|---|---|"
)


def _rows(res: dict, m: int, modes: tuple[str, ...]) -> str:
    raw = res[(m, RAW)]
    lines = []
    for k in (RAW, *modes):
        r = res[(m, k)]
        ratio = "-" if k == RAW else f"{100 * r['median_gbps'] / raw['median_gbps']:.0f} %"
        path = "raw TCP sendall -> recv_into" if k == RAW else f"gRPC, {k}"
        lines.append(
            f"| {_size(m)} | {path} | {_bm(r)} | {ratio} | {r['rx_cpu_s_per_gb']:.2f} | {r['tx_cpu_s_per_gb']:.2f} "
            f"| {r['rx_faults_per_mib']:.0f} |"
        )
    return "\n".join(lines)


def run_handoff_bench(
    total_mib: int = 256,
    repeats: int = 3,
    sizes: list[int] | None = None,
    seed: int = 0,
    variants: bool = True,
    variant_sizes: list[int] | None = None,
    malloc: bool = True,
) -> dict:
    import google.protobuf
    import grpc

    sizes = list(sizes or DEFAULT_SIZES)
    variant_sizes = list(variant_sizes or [1 * MIB])
    t = make_tensor(total_mib * MIB, seed)
    print(
        f"handoff bench: {total_mib} MiB bfloat16 tensor, best / median of {repeats} (raw and gRPC interleaved), "
        f"127.0.0.1, {os.cpu_count()} cores, torch {torch.__version__}, grpcio {grpc.__version__}, "
        f"protobuf {google.protobuf.__version__}, load average {os.getloadavg()[0]:.1f} at start",
        flush=True,
    )

    out: dict = {}
    print("\nglibc malloc defaults:\n\n" + _HEAD)
    res = out["default"] = bench_window(t, seed, sizes, repeats, [])
    for m in sizes:
        print(_rows(res, m, MODES), flush=True)

    bd = out["breakdown"] = breakdown(t, sizes)
    steps = list(next(iter(bd.values())))
    ws = min(64, total_mib)
    print(f"\nper-byte steps alone, GB/s (streaming through {ws} MiB of distinct messages):\n")
    print("| message | " + " | ".join(steps) + " |")
    print("|---|" + "---|" * len(steps))
    for m in sizes:
        print(f"| {_size(m)} | " + " | ".join(f"{bd[m][s] / 1e9:.1f}" for s in steps) + " |", flush=True)

    tuned = malloc and tune_malloc()  # cannot be undone in this process: everything after is tuned
    if tuned:
        print(
            "\nglibc malloc tuned in both processes (mallopt M_MMAP_THRESHOLD 1 GiB, M_TRIM_THRESHOLD 1 GiB, "
            "M_ARENA_MAX 1):\n\n" + _HEAD
        )
        res_t = out["tuned"] = bench_window(t, seed, sizes, repeats, [], (ASSEMBLE, BYTES), malloc_tuned=True)
        for m in sizes:
            print(_rows(res_t, m, (ASSEMBLE, BYTES)), flush=True)

    if variants:
        var = out["variants"] = {}
        print(
            f"\ngRPC option variants (client and server both get them; malloc {'tuned' if tuned else 'defaults'}), "
            "GB/s best / median (gRPC / raw TCP in the same window), receiver CPU s/GB:\n"
        )
        print(
            "| options | message | raw TCP | "
            + f"{ASSEMBLE} | receiver CPU s/GB | {BYTES} | receiver CPU s/GB |\n|---|---|---|---|---|---|---|"
        )
        for name, extra in VARIANTS.items():
            r = bench_window(t, seed, variant_sizes, repeats, extra, (ASSEMBLE, BYTES), malloc_tuned=tuned)
            for m in variant_sizes:
                raw = r[(m, RAW)]
                cells = [_bm(raw)]
                for mode in (ASSEMBLE, BYTES):
                    v = var[(name, m, mode)] = r[(m, mode)]
                    pct = 100 * v["median_gbps"] / raw["median_gbps"]
                    cells.append(f"{_bm(v)} ({pct:.0f} %) | {v['rx_cpu_s_per_gb']:.2f}")
                print(f"| {name} | {_size(m)} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total-mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sizes-kib", type=int, nargs="+", default=None, help="gRPC message sizes (KiB)")
    p.add_argument("--variant-sizes-kib", type=int, nargs="+", default=None, help="sizes for the option variants")
    p.add_argument("--no-variants", action="store_true", help="skip the grpc option variants")
    p.add_argument("--no-malloc", action="store_true", help="skip the tuned-malloc sweep")
    a = p.parse_args(argv)
    sizes = [s * KIB for s in a.sizes_kib] if a.sizes_kib else None
    vsizes = [s * KIB for s in a.variant_sizes_kib] if a.variant_sizes_kib else None
    run_handoff_bench(
        a.total_mib, a.repeats, sizes, variants=not a.no_variants, variant_sizes=vsizes, malloc=not a.no_malloc
    )


if __name__ == "__main__":
    main()
