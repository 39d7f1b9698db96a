"""Pulling one request's handoff: the prefill worker's stream, and the stage streams and lanes its header
announces.

A pipelined prefill worker (pp > 1) streams stage 0's layers itself and names an endpoint per other stage
(engine/parallel/stage_stream.py); a handoff pulled over lanes (engine/kv_transfer/lanes.py) has its
prefill stream's share dealt over lanes 1.. as well. Each is pulled concurrently into the same consumer,
which returns the result once every stream has ended and everything checked out. A side stream that fails
cancels the prefill stream, so the caller sees that stream's error within the time it takes to notice it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial

import grpc

from engine.kv_transfer.codec import HandoffError
from engine.kv_transfer.consumer import HandoffConsumer, HandoffResult
from engine.kv_transfer.socket_lanes import SocketLaneFailed, pull_socket_lane
from tandem.rpc import prefill_pb2 as pb

StageCall = Callable[[str], grpc.aio.UnaryStreamMultiCallable]
LaneCall = Callable[[int], grpc.aio.UnaryStreamMultiCallable]
"""lane -> PullLane on a connection of that lane's own, to the prefill worker"""


class StageStreamFailed(Exception):
    """A prefill stage's stream or a lane broke (the process died, or it aborted the request)."""

    def __init__(self, what: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{what}: {code.name}: {details}")
        self.code = code

    @classmethod
    def of_rpc(cls, what: str, error: grpc.aio.AioRpcError) -> StageStreamFailed:
        return cls(what, error.code(), error.details() or "")

    @classmethod
    def of_socket(cls, error: SocketLaneFailed) -> StageStreamFailed:
        return cls(error.what, grpc.StatusCode.__members__.get(error.code, grpc.StatusCode.UNAVAILABLE), error.details)


def _failure(what: str, e: BaseException) -> BaseException:
    """What a side stream's error means to the caller: a broken transport as StageStreamFailed (with its
    status), anything else (a refused handoff) as it is."""
    if isinstance(e, grpc.aio.AioRpcError):
        return StageStreamFailed.of_rpc(what, e)
    if isinstance(e, SocketLaneFailed):
        return StageStreamFailed.of_socket(e)
    if isinstance(e, TimeoutError):
        return StageStreamFailed(what, grpc.StatusCode.DEADLINE_EXCEEDED, "the handoff's deadline passed")
    return e


async def pull_handoff(
    call: grpc.aio.UnaryStreamCall,
    consumer: HandoffConsumer,
    stage_call: StageCall,
    rid: str,
    timeout: float | None,
    lane_call: LaneCall | None = None,
) -> HandoffResult:
    tasks: list[asyncio.Task] = []
    failed: list[BaseException] = []

    async def side(what: str, pull: Awaitable, ended: Callable[[], bool], on_cancel=None) -> HandoffResult | None:
        """One stream besides the prefill stream (a stage stream, a gRPC or a socket lane): ``pull`` feeds
        it to the consumer and returns the consumer's last result; a failure cancels the prefill stream."""
        try:
            result = await pull
            if not ended():
                raise HandoffError(f"{what} ended without an end marker")
            return result
        except asyncio.CancelledError:
            if on_cancel is not None:
                on_cancel()
            raise
        except BaseException as e:
            failed.append(_failure(what, e))
            call.cancel()  # the prefill stream waits for nothing now
            raise failed[-1] from None

    async def drain(scall: grpc.aio.UnaryStreamCall, accept) -> HandoffResult | None:
        result = None
        async for msg in scall:
            result = accept(msg)
        return result

    def side_streams() -> list[asyncio.Task]:
        on_sockets = bool(consumer.data_endpoint)
        if consumer.lanes > 1 and not on_sockets and lane_call is None:
            raise HandoffError(f"the producer dealt the handoff over {consumer.lanes} lanes; none were asked for")
        lanes = range(1, consumer.lanes)
        socket_lanes, grpc_lanes = (lanes, ()) if on_sockets else ((), lanes)  # engine/kv_transfer/socket_lanes.py
        out = []
        for lane in socket_lanes:
            pull = pull_socket_lane(consumer.data_endpoint, rid, lane, partial(consumer.accept_lane, lane))
            pull = asyncio.wait_for(pull, timeout) if timeout else pull
            out.append(side(f"socket lane {lane}", pull, partial(consumer.lane_ended, lane)))
        for s in consumer.stage_streams:
            scall = stage_call(s.endpoint)(pb.StagePullRequest(request_id=rid, stage=s.stage), timeout=timeout)
            pull = drain(scall, partial(consumer.accept_stage, s.stage))
            what = f"prefill stage {s.stage} at {s.endpoint}"
            out.append(side(what, pull, partial(consumer.stream_ended, s.stage), scall.cancel))
        for lane in grpc_lanes:
            lcall = lane_call(lane)(pb.LanePullRequest(request_id=rid, lane=lane), timeout=timeout)
            pull = drain(lcall, partial(consumer.accept_lane, lane))
            out.append(side(f"handoff lane {lane}", pull, partial(consumer.lane_ended, lane), lcall.cancel))
        return [asyncio.create_task(c) for c in out]

    result = None
    started = False
    try:
        async for msg in call:
            r = consumer.accept(msg)
            if not started:  # the header was the first message: every side stream is known now
                started = True
                tasks = side_streams()
            result = r or result
        if not consumer.stream_ended(0):
            raise HandoffError("prefill stream ended without an end marker")
        for t in tasks:
            result = await t or result
        assert result is not None  # every stream ended and was checked: the consumer returned its result
        return result
    except (asyncio.CancelledError, grpc.aio.AioRpcError):
        if failed:  # a side stream's error cancelled the prefill stream: report the cause
            raise failed[0] from None
        raise
    finally:
        for t in tasks:
            if t.done() and not t.cancelled():
                t.exception()  # retrieved here (it is reported above), so asyncio does not log it again
            t.cancel()
