"""Pulling one request's handoff: the prefill worker's stream, and the stage streams its header announces.

A pipelined prefill worker (pp > 1) streams stage 0's layers itself and names an endpoint per other stage
(engine/parallel/stage_stream.py); each is pulled concurrently into the same consumer, which returns the
result once every stream has ended and everything checked out. A stage stream that fails cancels the
prefill stream, so the caller sees that stage's error within the time it takes to notice it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from engine.kv_transfer.codec import HandoffError
from engine.kv_transfer.consumer import HandoffConsumer, HandoffResult
from tandem.rpc import prefill_pb2 as pb

StageCall = Callable[[str], grpc.aio.UnaryStreamMultiCallable]


class StageStreamFailed(Exception):
    """A prefill stage's stream broke (the stage's process died, or it aborted the request)."""

    def __init__(self, stage: int, endpoint: str, error: grpc.aio.AioRpcError) -> None:
        super().__init__(f"prefill stage {stage} at {endpoint}: {error.code().name}: {error.details()}")
        self.code = error.code()


async def pull_handoff(
    call: grpc.aio.UnaryStreamCall, consumer: HandoffConsumer, stage_call: StageCall, rid: str, timeout: float | None
) -> HandoffResult:
    tasks: list[asyncio.Task] = []
    failed: list[BaseException] = []

    async def pull_stage(s: pb.StageStream) -> HandoffResult | None:
        scall = stage_call(s.endpoint)(pb.StagePullRequest(request_id=rid, stage=s.stage), timeout=timeout)
        try:
            result = None
            async for msg in scall:
                result = consumer.accept_stage(s.stage, msg)
            if not consumer.stream_ended(s.stage):
                raise HandoffError(f"stage {s.stage}'s stream from {s.endpoint} ended without an end marker")
            return result
        except asyncio.CancelledError:
            scall.cancel()
            raise
        except grpc.aio.AioRpcError as e:
            failed.append(StageStreamFailed(s.stage, s.endpoint, e))
            call.cancel()
            raise failed[-1] from None
        except BaseException as e:
            failed.append(e)
            call.cancel()  # the prefill stream waits for nothing now
            raise

    result = None
    try:
        async for msg in call:
            r = consumer.accept(msg)
            if consumer.stage_streams and not tasks:
                tasks = [asyncio.create_task(pull_stage(s)) for s in consumer.stage_streams]
            result = r or result
        if not consumer.stream_ended(0):
            raise HandoffError("prefill stream ended without an end marker")
        for t in tasks:
            result = await t or result
        assert result is not None  # every stream ended and was checked: the consumer returned its result
        return result
    except (asyncio.CancelledError, grpc.aio.AioRpcError):
        if failed:  # a stage stream's error cancelled the prefill stream: report the cause
            raise failed[0] from None
        raise
    finally:
        for t in tasks:
            if t.done() and not t.cancelled():
                t.exception()  # retrieved here (it is reported above), so asyncio does not log it again
            t.cancel()
