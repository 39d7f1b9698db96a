"""Handoff lanes over plain sockets: the same lanes as ``Prefill/PullLane`` (engine/kv_transfer/lanes.py), with
the bytes outside gRPC's Python layer.

Why: on loopback the decode worker's gRPC receive path moved a handoff at 42-43 % of a raw socket's rate on
the 2-core host and 23-35 % on a 16-core one, and no client option, lane count or thread layout raised it
(docs/PERFORMANCE.md, "handoff lanes"); the same messages, framed on a socket and fed to the same consumer,
ran at 76-115 % (``python -m bench.handoff``). gRPC keeps the control: the Prefill stream carries the header
(fingerprint, lanes, ``data_endpoint``), block hashes, first token and end marker; with socket lanes every kv /
state message goes to lanes 1.. (``Dealer(skip_lane0=True)``), each lane ends with its counted end marker
and every payload keeps its CRC-32, all checked by the consumer as before. The default data plane: decode
``--handoff-transport socket``, prefill ``--handoff-data-port 0`` (any free port; ``off``: gRPC lanes only).

Frames (little-endian):

    request   u32 n, LanePullRequest (n bytes)                 consumer -> producer, once per connection
    message   u32 n (< 2^31), one HandoffChunk's bytes           a kv / state message as the producer encoded
                                                                 it (wire.EncodedChunk), then the end marker
    error     u32 (2^31 | n), "CODE: details" (n bytes, UTF-8)   the lane is refused or its handoff failed;
                                                                 the connection closes after it

A lane's messages are read straight into buffers of the lane's own (``recv_into``: one copy, by the kernel)
on a thread that also computes each payload's CRC-32 while it is in cache; a second thread hands them to the
consumer, which verifies and copies each payload into the pages, while the first reads the next. Both ends
use TCP keepalive (a dead host is noticed in ~5 s); a dead process closes the socket at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import socket
import struct
import threading
from collections.abc import Callable
from functools import partial

from google.protobuf.message import DecodeError

from engine.kv_transfer.codec import HandoffError, crc32
from engine.kv_transfer.lanes import HandoffLanes, LaneRefused
from engine.kv_transfer.wire import ReceivedChunk, StreamCount, parse_chunk
from tandem.rpc import prefill_pb2 as pb

logger = logging.getLogger(__name__)

ERROR_FLAG = 1 << 31
MAX_FRAME = 64 << 20
"""Largest message frame accepted (messages are at most 16 MiB of payload plus their metadata)."""
MAX_REQUEST = 4096
REQUEST_TIMEOUT_S = 5.0
_U32 = struct.Struct("<I")


class SocketLaneFailed(Exception):
    """A socket lane broke or was refused; ``code`` names why (a gRPC status name, or UNAVAILABLE)."""

    def __init__(self, what: str, code: str, details: str) -> None:
        super().__init__(f"{what}: {code}: {details}")
        self.what, self.code, self.details = what, code, details


def keepalive(sock: socket.socket) -> None:
    """Low latency, and a dead peer noticed in ~5 s (2 s idle, then 3 probes a second apart)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # Linux; other platforms keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def error_frame(code: str, details: str) -> bytes:
    body = f"{code}: {details}".encode()[:65536]
    return _U32.pack(ERROR_FLAG | len(body)) + body


# ---- producer side --------------------------------------------------------------------------------------


async def serve_socket_lanes(
    lanes: HandoffLanes, host: str, port: int, on_outcome: Callable[[str, int], None] | None = None
) -> asyncio.Server:
    """Serve the lanes of ``lanes`` on host:port (0: any free port; read it from the server's sockets).
    ``on_outcome(outcome, payload_bytes)`` after each lane: ok / refused / cancelled (metrics)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        keepalive(writer.get_extra_info("socket"))
        count, outcome = StreamCount(), "cancelled"
        try:
            # a connection that never asks holds nothing for long
            n = _U32.unpack(await asyncio.wait_for(reader.readexactly(4), REQUEST_TIMEOUT_S))[0]
            if n > MAX_REQUEST:
                writer.write(error_frame("INVALID_ARGUMENT", f"a lane request of {n} bytes (at most {MAX_REQUEST})"))
                outcome = "refused"
                return
            req = pb.LanePullRequest.FromString(await asyncio.wait_for(reader.readexactly(n), REQUEST_TIMEOUT_S))
            messages = lanes.pull(req.request_id, req.lane, count)
            try:
                async for msg in messages:
                    data = msg if isinstance(msg, bytes) else msg.SerializeToString()
                    writer.write(_U32.pack(len(data)))
                    writer.write(data)
                    await writer.drain()  # the consumer's pace: at most a socket buffer ahead
                    if not isinstance(msg, bytes):
                        outcome = "ok"  # the end marker went out
            except LaneRefused as e:
                outcome = "refused"
                writer.write(error_frame(e.code.name, str(e)))
            finally:
                await messages.aclose()  # the registry learns now that this lane is done with
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, OSError, TimeoutError) as e:
            logger.debug("socket lane connection ended: %r", e)
        except Exception as e:  # a malformed request: tell the consumer, then close
            outcome = "refused"
            writer.write(error_frame("INVALID_ARGUMENT", f"bad lane request: {e}"))
        finally:
            if on_outcome is not None:
                on_outcome(outcome, count.payload)
            writer.close()

    return await asyncio.start_server(handle, host, port)


# ---- consumer side ----------------------------------------------------------------------------------------


async def _connect(loop: asyncio.AbstractEventLoop, host: str, port: str, what: str) -> socket.socket:
    """A non-blocking connected socket, within 5 s (the event loop keeps running meanwhile)."""
    try:
        family, kind, proto, _, addr = (await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM))[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, ValueError) as e:
        raise SocketLaneFailed(what, "UNAVAILABLE", f"cannot resolve: {e}") from None
    sock.setblocking(False)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, addr), 5.0)
    except (OSError, TimeoutError) as e:
        sock.close()
        raise SocketLaneFailed(what, "UNAVAILABLE", f"cannot connect: {e!r}") from None
    except BaseException:
        sock.close()
        raise
    return sock


async def pull_socket_lane(
    endpoint: str,
    rid: str,
    lane: int,
    accept: Callable[[ReceivedChunk | pb.HandoffChunk], object],
    buffer_bytes: int = 1 << 20,
) -> object:
    """Pull lane ``lane`` of handoff ``rid`` from ``endpoint`` ("host:port"), giving each message to
    ``accept`` (the consumer's ``accept_lane``, called on the lane's placing thread) until the end marker.
    Raises SocketLaneFailed (transport, refusal) or whatever ``accept`` raises (HandoffError); cancelling
    closes the connection. Returns what ``accept`` returned last that was not None (the consumer's result,
    when this lane completed the handoff)."""
    what = f"socket lane {lane} at {endpoint}"
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")  # an IPv6 literal
    loop = asyncio.get_running_loop()
    sock = await _connect(loop, host, port, what)
    threads = None
    try:
        keepalive(sock)
        req = pb.LanePullRequest(request_id=rid, lane=lane).SerializeToString()
        await loop.sock_sendall(sock, _U32.pack(len(req)) + req)
        sock.setblocking(True)  # from here on the lane's threads read it (and the reader closes it)
        done: asyncio.Future = loop.create_future()
        threads = _LaneThreads(sock, what, accept, buffer_bytes, partial(_settle, loop, done))
        threads.start()
        try:
            return await done
        finally:
            threads.stop()
    finally:
        if threads is None:
            sock.close()


def _settle(loop: asyncio.AbstractEventLoop, done: asyncio.Future, result: object, error: BaseException | None) -> None:
    def settle() -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits for this lane any more
        loop.call_soon_threadsafe(settle)


class _LaneThreads:
    """A lane's two threads: ``receive`` reads each frame into one of a few buffers and computes its
    payload's CRC-32 while the bytes are still in cache; ``place`` hands the parsed message to ``accept``
    (which copies the payload into the pages). Both release the GIL for the bulk of their work (recv_into,
    crc32, numpy's copy), so receiving the next message overlaps placing this one, and the event loop stays
    free for the worker's other requests. A slow consumer stops the reader when the buffers run out (the
    producer then waits on the socket): memory stays bounded."""

    DEPTH = 3

    def __init__(
        self,
        sock: socket.socket,
        what: str,
        accept: Callable[[ReceivedChunk | pb.HandoffChunk], object],
        buffer_bytes: int,
        settle: Callable[[object, BaseException | None], None],
    ) -> None:
        self.sock, self.what, self.accept, self.settle = sock, what, accept, settle
        self.free: queue.SimpleQueue[bytearray | None] = queue.SimpleQueue()
        for _ in range(self.DEPTH):
            self.free.put(bytearray(buffer_bytes))
        self.full: queue.SimpleQueue[tuple | BaseException] = queue.SimpleQueue()
        self.stopped = threading.Event()
        self._threads = [
            threading.Thread(target=self._receive, name=f"{what} receive", daemon=True),
            threading.Thread(target=self._place, name=f"{what} place", daemon=True),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Wake both threads and let them end (the socket is shut, a blocked reader returns at once)."""
        if self.stopped.is_set():
            return
        self.stopped.set()
        self.free.put(None)
        self.full.put(SocketLaneFailed(self.what, "CANCELLED", "the lane was abandoned"))
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _recv_exact(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            try:
                n = self.sock.recv_into(view[got:])
            except OSError as e:
                raise SocketLaneFailed(self.what, "UNAVAILABLE", str(e)) from None
            if n == 0:
                raise SocketLaneFailed(self.what, "UNAVAILABLE", "the producer closed the connection mid-lane")
            got += n

    def _receive(self) -> None:
        size = bytearray(4)
        try:
            while not self.stopped.is_set():
                self._recv_exact(memoryview(size))
                n = _U32.unpack(size)[0]
                if n & ERROR_FLAG:
                    body = bytearray(min(n & ~ERROR_FLAG, 65536))
                    self._recv_exact(memoryview(body))
                    code, _, details = body.decode(errors="replace").partition(": ")
                    raise SocketLaneFailed(self.what, code, details)
                if n > MAX_FRAME:
                    raise HandoffError(f"{self.what}: a frame of {n} bytes (at most {MAX_FRAME})")
                buf = self.free.get()
                if buf is None:
                    return
                if n > len(buf):
                    buf = bytearray(n)
                self._recv_exact(memoryview(buf)[:n])
                try:
                    msg = parse_chunk(memoryview(buf)[:n])
                except DecodeError:
                    raise HandoffError(f"{self.what}: a message could not be decoded") from None
                if isinstance(msg, ReceivedChunk):
                    msg = ReceivedChunk(msg.chunk, msg.data, crc32(msg.data))
                self.full.put((buf, msg))
                chunk = msg.chunk if isinstance(msg, ReceivedChunk) else msg
                if chunk.WhichOneof("payload") == "end":
                    return
        except BaseException as e:
            self.full.put(e)
        finally:
            self.sock.close()  # here, not on the loop: no other thread may still read this descriptor

    def _place(self) -> None:
        result, error = None, None
        try:
            while True:
                item = self.full.get()
                if isinstance(item, BaseException):
                    raise item
                buf, msg = item
                result = self.accept(msg) or result
                self.free.put(buf)  # its payload is in the pages now
                chunk = msg.chunk if isinstance(msg, ReceivedChunk) else msg
                if chunk.WhichOneof("payload") == "end":
                    return
        except BaseException as e:
            error = e
        finally:
            if error is not None:
                self.stop()  # the reader may wait for a buffer or a frame: release it
            self.settle(result, error)


__all__ = ["MAX_FRAME", "SocketLaneFailed", "error_frame", "keepalive", "pull_socket_lane", "serve_socket_lanes"]
