"""gRPC Decode service.

Pull, not push: the decode worker reserves pages and a slot *first*, then pulls the handoff from
the prefill worker into them. Memory is only committed by the side that will hold it, so a slow or
dead consumer cannot strand producer memory, and a consumer never receives bytes it has no room
for (the push-mode leak of vLLM #46283). The producer frees its blocks as soon as its prefill step
ends; the consumer frees its reservation on any failure before decoding starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from functools import partial

import grpc
import torch

from decode_svc.config import DecodeConfig
from decode_svc.pull import StageStreamFailed, pull_handoff
from engine.async_engine import AsyncEngine
from engine.fingerprint import Fingerprint
from engine.kv_transfer.codec import HandoffError
from engine.kv_transfer.consumer import HandoffConsumer, fingerprint_to_pb
from engine.kv_transfer.wire import lane_pull_call, prefill_call, stage_pull_call
from engine.llm_engine import ImportReservation, RequestOutput
from kvstore.store import PrefixStore
from tandem.convert import logprobs_to_pb, params_from_pb
from tandem.grpc_util import channel, own_connection_channel
from tandem.metrics import WorkerMetrics
from tandem.rpc import common_pb2 as cpb
from tandem.rpc import decode_pb2 as pb
from tandem.rpc import decode_pb2_grpc

logger = logging.getLogger(__name__)

_GRPC_TO_GRPC = {  # producer failures as seen by the router
    grpc.StatusCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class DecodeService(decode_pb2_grpc.DecodeServicer):
    def __init__(
        self,
        config: DecodeConfig,
        aengine: AsyncEngine,
        fingerprint: Fingerprint,
        metrics: WorkerMetrics,
        model_name: str,
        store: PrefixStore | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.aengine = aengine
        self.engine = aengine.engine
        self.fingerprint = fingerprint
        self.metrics = metrics
        self.model_name = model_name
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._lane_channels: dict[tuple[str, int], grpc.aio.Channel] = {}

    async def Info(self, request: cpb.WorkerInfoRequest, context: grpc.aio.ServicerContext) -> cpb.WorkerInfo:
        spec = self.config.speculative
        return cpb.WorkerInfo(
            role=cpb.DECODE,
            model_name=self.model_name,
            fingerprint=fingerprint_to_pb(self.fingerprint),
            speculative=spec.enabled,
            speculative_method=spec.method or "",
            num_speculative_tokens=spec.num_speculative_tokens,
            max_model_len=self.engine.max_model_len,
            outstanding_requests=self.engine.num_outstanding,
        )

    def _drafter_taps(self) -> tuple[int, ...]:
        d = self.engine.drafter
        return tuple(d.aux_layer_ids) if d is not None and d.needs_aux else ()

    def _channel(self, endpoint: str) -> grpc.aio.Channel:
        if endpoint not in self._channels:
            self._channels[endpoint] = channel(endpoint)
        return self._channels[endpoint]

    def _prefill_call(self, endpoint: str) -> grpc.aio.UnaryStreamMultiCallable:
        return prefill_call(self._channel(endpoint))

    def _stage_call(self, endpoint: str) -> grpc.aio.UnaryStreamMultiCallable:
        return stage_pull_call(self._channel(endpoint))

    def _lane_call(self, endpoint: str, lane: int) -> grpc.aio.UnaryStreamMultiCallable:
        """PullLane on lane ``lane``'s own connection (gRPC would otherwise share one per endpoint)."""
        key = (endpoint, lane)
        if key not in self._lane_channels:
            self._lane_channels[key] = own_connection_channel(endpoint)
        return lane_pull_call(self._lane_channels[key])

    async def _reserve(self, rid: str, n: int, context: grpc.aio.ServicerContext) -> ImportReservation:
        deadline = time.monotonic() + self.config.reserve_timeout_s
        while True:
            res = await self.aengine.call(lambda e: e.reserve_import(rid, n))
            if res is not None:
                return res
            if time.monotonic() > deadline:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"no KV pages / slots free for {n} tokens")
            await asyncio.sleep(0.01)

    async def Generate(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        prompt = list(request.prefill.prompt_token_ids)
        try:
            params = params_from_pb(request.params)
            if request.HasField("speculative"):  # per-request k; the engine's setting caps it
                params = dataclasses.replace(params, num_speculative_tokens=request.speculative.num_speculative_tokens)
            self.engine._validate(prompt, params)
        except ValueError as e:
            self.metrics.requests.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not request.prefill_endpoint:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prefill_endpoint is required")

        t0 = time.monotonic()
        res = await self._reserve(rid, len(prompt), context)
        inserted = finished = False
        q = self.aengine.open_stream(rid)
        try:
            result = await self._pull(request, res, context)
            aux = None
            taps = self._drafter_taps()
            if taps and result.aux_hidden is not None:
                aux = torch.cat([result.aux_hidden[t] for t in taps])
            out: RequestOutput = await self.aengine.call(
                lambda e: e.insert_prefilled(
                    res, prompt, params, result.first_token, result.first_logprobs, request.prefill.cache_salt, aux
                )
            )
            inserted = True
            self.metrics.ttft.observe(time.monotonic() - t0)
            sent = 0
            t_first = time.monotonic()
            while True:
                new = out.output_token_ids[sent:]
                if new or out.finished:
                    chunk = pb.TokenChunk(
                        token_ids=new,
                        finished=out.finished,
                        finish_reason=out.finish_reason or "",
                        num_drafted=out.num_drafted,
                        num_accepted=out.num_accepted,
                        num_verify_steps=out.num_verify_steps,
                    )
                    if params.logprobs is not None:
                        chunk.logprobs.extend(logprobs_to_pb(lp) for lp in out.logprobs[sent:])
                    sent = len(out.output_token_ids)
                    yield chunk
                if out.finished:
                    finished = True
                    if out.num_drafted:
                        self.metrics.spec_drafted.inc(out.num_drafted)
                        self.metrics.spec_accepted.inc(out.num_accepted)
                        self.metrics.spec_verify_steps.inc(out.num_verify_steps)
                        self.metrics.spec_acceptance.observe(out.acceptance_rate)
                        self.metrics.spec_accepted_length.observe(out.mean_accepted_length)
                    if sent > 1:
                        self.metrics.tpot.observe((time.monotonic() - t_first) / (sent - 1))
                    self.metrics.requests.labels("ok").inc()
                    return
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                out = item
        except asyncio.CancelledError:
            self.metrics.requests.labels("cancelled").inc()
            raise
        finally:
            self.aengine.close_stream(rid)
            if not inserted:
                await asyncio.shield(self.aengine.call(lambda e: e.release_import(res)))
            elif not finished:
                await asyncio.shield(self.aengine.abort(rid))

    async def _pull(self, request: pb.DecodeRequest, res: ImportReservation, context: grpc.aio.ServicerContext):
        prefill_req = request.prefill
        prefill_req.request_id = request.request_id
        prefill_req.ClearField("speculative")  # never forward speculative settings to a producer
        prefill_req.consumer_fingerprint.CopyFrom(fingerprint_to_pb(self.fingerprint))
        prefill_req.ClearField("aux_layer_ids")
        prefill_req.aux_layer_ids.extend(self._drafter_taps())  # so the first decode step already drafts
        prefill_req.lanes = self.config.lanes_to_ask
        prefill_req.socket_lanes = self.config.handoff_transport == "socket"
        cache, page_ids, slot_ids = self.engine.import_target(res)  # a parallel engine stages and reslices
        consumer = HandoffConsumer(
            self.engine.model_config,
            cache,
            self.fingerprint,
            len(prefill_req.prompt_token_ids),
            page_ids,
            slot_ids,
            max_lanes=self.config.lanes_to_ask,
        )
        remaining = context.time_remaining()
        self.metrics.live_transfers.inc()
        t0 = time.monotonic()
        call = self._prefill_call(request.prefill_endpoint)(prefill_req, timeout=remaining)
        try:
            lanes = partial(self._lane_call, request.prefill_endpoint)
            result = await pull_handoff(call, consumer, self._stage_call, request.request_id, remaining, lanes)
            self.metrics.transfer_bytes.inc(result.payload_bytes)
            self.metrics.transfer_seconds.observe(time.monotonic() - t0)
            return result
        except HandoffError as e:
            call.cancel()
            self.metrics.requests.labels("bad_handoff").inc()
            logger.warning("request %s: handoff refused: %s", request.request_id, e)
            await context.abort(grpc.StatusCode.DATA_LOSS, f"handoff from {request.prefill_endpoint} refused: {e}")
        except StageStreamFailed as e:
            self.metrics.requests.labels("prefill_failed").inc()
            await context.abort(_GRPC_TO_GRPC.get(e.code, grpc.StatusCode.UNAVAILABLE), str(e))
        except grpc.aio.AioRpcError as e:
            self.metrics.requests.labels("prefill_failed").inc()
            code = _GRPC_TO_GRPC.get(e.code(), grpc.StatusCode.UNAVAILABLE)
            await context.abort(code, f"prefill worker {request.prefill_endpoint}: {e.code().name}: {e.details()}")
        finally:
            consumer.close()  # a socket lane's placing thread writes nothing after this: the pages can go
            self.metrics.live_transfers.dec()
