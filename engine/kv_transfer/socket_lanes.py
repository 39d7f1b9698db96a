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

A lane's messages are read straight into a buffer of the lane's own (``sock_recv_into``: one copy, by the
kernel) and handed to the consumer, which verifies and copies each payload into the pages before the next is
read. Both ends use TCP keepalive (a dead host is noticed in ~5 s); a dead process closes the socket at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable

from engine.kv_transfer.codec import HandoffError
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


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview, what: str) -> None:
    got = 0
    while got < len(view):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise SocketLaneFailed(what, "UNAVAILABLE", "the producer closed the connection mid-lane")
        got += n


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
    ``accept`` (the consumer's ``accept_lane``) until the end marker. Raises SocketLaneFailed (transport,
    refusal) or whatever ``accept`` raises (HandoffError); cancelling closes the connection. Returns what
    ``accept`` returned last that was not None (the consumer's result, when this lane completed the handoff)."""
    what = f"socket lane {lane} at {endpoint}"
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")  # an IPv6 literal
    loop = asyncio.get_running_loop()
    sock = await _connect(loop, host, port, what)
    try:
        keepalive(sock)
        req = pb.LanePullRequest(request_id=rid, lane=lane).SerializeToString()
        await loop.sock_sendall(sock, _U32.pack(len(req)) + req)
        size, buf, result = bytearray(4), bytearray(buffer_bytes), None
        while True:
            try:
                await _recv_exact(loop, sock, memoryview(size), what)
            except OSError as e:
                raise SocketLaneFailed(what, "UNAVAILABLE", str(e)) from None
            n = _U32.unpack(size)[0]
            if n & ERROR_FLAG:
                body = bytearray(min(n & ~ERROR_FLAG, 65536))
                await _recv_exact(loop, sock, memoryview(body), what)
                code, _, details = body.decode(errors="replace").partition(": ")
                raise SocketLaneFailed(what, code, details)
            if n > MAX_FRAME:
                raise HandoffError(f"{what}: a frame of {n} bytes (at most {MAX_FRAME})")
            if n > len(buf):
                buf = bytearray(n)
            view = memoryview(buf)[:n]
            await _recv_exact(loop, sock, view, what)
            msg = parse_chunk(view)  # payload views buf: the consumer copies it into the pages in accept
            result = accept(msg) or result
            chunk = msg.chunk if isinstance(msg, ReceivedChunk) else msg
            if chunk.WhichOneof("payload") == "end":
                return result
    finally:
        sock.close()


__all__ = ["MAX_FRAME", "SocketLaneFailed", "error_frame", "keepalive", "pull_socket_lane", "serve_socket_lanes"]
