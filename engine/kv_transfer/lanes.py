"""Handoff lanes (producer side): one handoff's kv / state messages dealt over several streams (gRPC PullLane
streams, or sockets: engine/kv_transfer/socket_lanes.py).

One TCP flow is often what limits a long transfer over a real network; lanes give a handoff several. (On
loopback they did not speed up one receiving process: gRPC's Python receive path is the limit there, see
docs/PERFORMANCE.md "handoff lanes"; the default is one lane.) A consumer that asks for ``lanes`` > 1
pulls lanes 1 .. n-1 with ``Prefill/PullLane``, each on its own connection, beside the Prefill stream
(lane 0):

    Prefill stream (lane 0)   header{lanes=n} . msg 0 . msg n   ... block_hashes . first_token . end
    PullLane(lane=1)          msg 1 . msg n+1 ...                                                . end
    ...

The producer deals messages round-robin as it emits them; each lane's end marker counts
its own messages and bytes, and the consumer uses nothing until every stream has ended and checked out.
A lane holds encoded bytes only (the pages are freed when the prefill ends, as without lanes). Lanes of
a finished handoff wait ``ttl_s`` to be pulled; a failed or cancelled handoff fails its lanes at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from engine.kv_transfer.wire import EncodedChunk, StreamCount
from tandem.rpc import prefill_pb2 as pb

MAX_LANES = 16


class LaneRefused(Exception):
    """A PullLane call that cannot be served; ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class _End:
    """The handoff's prefill finished: every message of this lane has been queued."""


@dataclass(frozen=True)
class _Failed:
    reason: str


@dataclass
class _LaneSet:
    queues: list[asyncio.Queue]  # lanes 1 .. n-1
    pulled: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)
    expiry: asyncio.TimerHandle | None = None


class Dealer:
    """The producer's delivery callback for one request (called from one thread: the engine's, or the
    producer's encoder): message k goes to lane k % n, or with ``skip_lane0`` (socket lanes: the Prefill
    stream keeps the control messages) to lane 1 + k % (n - 1)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        lane0: Callable[[EncodedChunk], None],
        queues: list,
        skip_lane0: bool = False,
    ) -> None:
        self.loop, self.lane0, self.queues = loop, lane0, queues
        self.first = 1 if skip_lane0 else 0
        self.next = self.first

    def __call__(self, chunk: EncodedChunk) -> None:
        i = self.next
        self.next = self.first if i >= len(self.queues) else i + 1
        if i == 0:
            self.lane0(chunk)
        else:  # the same thread-safe hop as lane 0's: FIFO with the request's final output
            self.loop.call_soon_threadsafe(self.queues[i - 1].put_nowait, chunk)


class HandoffLanes:
    """The lanes of the handoffs in flight on one prefill worker (used on its event loop)."""

    def __init__(self, max_lanes: int, ttl_s: float) -> None:
        self.max_lanes = max_lanes
        self.ttl_s = ttl_s
        self._sets: dict[str, _LaneSet] = {}

    def grant(self, requested: int) -> int:
        return max(1, min(requested, self.max_lanes))

    def open(
        self, rid: str, lanes: int, lane0: Callable[[EncodedChunk], None], skip_lane0: bool = False
    ) -> Callable[[EncodedChunk], None]:
        """Register the request's lanes; returns the delivery callback for the producer. ``skip_lane0``:
        every message to lanes 1.. (socket lanes; needs lanes >= 2)."""
        if lanes <= 1:
            if skip_lane0:
                raise ValueError("skip_lane0 needs a lane besides the Prefill stream")
            return lane0
        queues = [asyncio.Queue() for _ in range(lanes - 1)]
        self._sets[rid] = _LaneSet(queues)
        return Dealer(asyncio.get_running_loop(), lane0, queues, skip_lane0)

    def end(self, rid: str) -> None:
        """The prefill finished and every message was dealt (the engine's final output came after them)."""
        s = self._sets.get(rid)
        if s is None:
            return
        for q in s.queues:
            q.put_nowait(_End())
        s.expiry = asyncio.get_running_loop().call_later(self.ttl_s, self._sets.pop, rid, None)

    def fail(self, rid: str, reason: str) -> None:
        """The handoff failed or its consumer went away: lanes being pulled end with an error, the rest go."""
        s = self._sets.pop(rid, None)
        if s is None:
            return
        if s.expiry is not None:
            s.expiry.cancel()
        for q in s.queues:
            q.put_nowait(_Failed(reason))

    @property
    def live(self) -> int:
        return len(self._sets)

    async def pull(self, rid: str, lane: int, count: StreamCount) -> AsyncIterator[bytes | pb.HandoffChunk]:
        """What lane ``lane`` sends: its messages, counted in ``count``, then its end marker. Raises LaneRefused."""
        s = self._sets.get(rid)
        if s is None:
            raise LaneRefused(
                grpc.StatusCode.NOT_FOUND, f"no handoff {rid!r} with lanes here (ended, expired, unknown)"
            )
        if not 1 <= lane <= len(s.queues):
            raise LaneRefused(
                grpc.StatusCode.INVALID_ARGUMENT, f"handoff {rid!r} has lanes 1..{len(s.queues)}, not lane {lane}"
            )
        if lane in s.pulled:
            raise LaneRefused(grpc.StatusCode.FAILED_PRECONDITION, f"lane {lane} of handoff {rid!r} is already pulled")
        s.pulled.add(lane)
        q = s.queues[lane - 1]
        try:
            while True:
                item = await q.get()
                if isinstance(item, _End):
                    yield count.end()
                    return
                if isinstance(item, _Failed):
                    raise LaneRefused(grpc.StatusCode.ABORTED, f"handoff {rid!r}: {item.reason}")
                yield count.sent(item)
        finally:
            s.finished.add(lane)
            if len(s.finished) == len(s.queues) and self._sets.get(rid) is s:
                if s.expiry is not None:
                    s.expiry.cancel()
                del self._sets[rid]
