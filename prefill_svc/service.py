"""gRPC Prefill service: run a prompt, stream its pages and KDA state as layers finish, then the
first token. The request's blocks are freed when its prefill ends or the stream is cancelled."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Iterator

import grpc
import torch

from engine.async_engine import AsyncEngine
from engine.block_hash import block_hashes, namespace
from engine.fingerprint import Fingerprint
from engine.kv_transfer.codec import tensor_pieces
from engine.kv_transfer.consumer import fingerprint_from_pb, fingerprint_to_pb
from engine.kv_transfer.lanes import HandoffLanes, LaneRefused
from engine.kv_transfer.producer import HandoffProducer
from engine.kv_transfer.socket_lanes import serve_socket_lanes
from engine.kv_transfer.wire import EncodedChunk, StreamCount, encode_chunk
from engine.llm_engine import RequestOutput
from kvstore.store import PrefixStore
from prefill_svc.config import PrefillConfig
from tandem.convert import logprobs_to_pb, params_from_pb
from tandem.grpc_util import advertised_endpoint
from tandem.metrics import WorkerMetrics
from tandem.rpc import common_pb2 as cpb
from tandem.rpc import prefill_pb2 as pb
from tandem.rpc import prefill_pb2_grpc

logger = logging.getLogger(__name__)


def _aux_messages(out: RequestOutput, want: tuple[int, ...], max_bytes: int) -> Iterator[EncodedChunk]:
    """The requested taps, in the requested order, from what the engine captured."""
    if out.aux_hidden is None or not set(want) <= set(out.aux_layer_ids):
        raise RuntimeError(f"aux hidden states {want} were not captured (have {out.aux_layer_ids})")
    hidden = out.aux_hidden.shape[0] // len(out.aux_layer_ids)
    rows = [
        out.aux_hidden[out.aux_layer_ids.index(t) * hidden : (out.aux_layer_ids.index(t) + 1) * hidden] for t in want
    ]
    for piece, data in tensor_pieces(torch.cat(rows), max_bytes):
        yield encode_chunk(pb.HandoffChunk(aux_hidden=pb.AuxHidden(layer_ids=list(want), tensor=piece)), data)


class PrefillService(prefill_pb2_grpc.PrefillServicer):
    def __init__(
        self,
        config: PrefillConfig,
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
        self.namespace_digest = fingerprint.model_digest
        self.producer = HandoffProducer(self.engine.model_config, self.engine.cache, self.engine.config.page_size)
        self.engine.model.layer_hooks.append(self.producer.on_layer)
        self.engine.before_output_hooks.append(self.producer.flush)  # messages before the request's output
        self.engine.attach_handoff_producer(self.producer)  # other pipeline stages follow its registrations
        self._stage_streams: list[pb.StageStream] | None = None
        self._stage_lock = asyncio.Lock()
        self._outstanding_tokens = 0
        self.lanes = HandoffLanes(config.max_handoff_lanes, config.lane_ttl_s)
        metrics.lanes_held.set_function(lambda: self.lanes.live)
        self._data_server: asyncio.Server | None = None
        self._data_advertised: str | None = None  # "" once the data port failed to open
        self._data_lock = asyncio.Lock()

    async def Info(self, request: cpb.WorkerInfoRequest, context: grpc.aio.ServicerContext) -> cpb.WorkerInfo:
        return cpb.WorkerInfo(
            role=cpb.PREFILL,
            model_name=self.model_name,
            fingerprint=fingerprint_to_pb(self.fingerprint),
            speculative=False,
            max_model_len=self.engine.max_model_len,
            outstanding_requests=self.engine.num_outstanding,
            outstanding_tokens=self._outstanding_tokens,
        )

    async def _stages(self) -> list[pb.StageStream]:
        """Stages > 0 of a pipelined engine serve their own layers' share (started on the first request,
        on the engine thread, so no step runs meanwhile)."""
        async with self._stage_lock:
            if self._stage_streams is None:
                found = await self.aengine.call(
                    lambda e: e.start_stage_streams(self.config.host, self.config.advertise_host)
                )
                self._stage_streams = [
                    pb.StageStream(stage=s.stage, endpoint=s.endpoint, layers=s.layers) for s in found
                ]
            return self._stage_streams

    async def _data_endpoint(self) -> str:
        """host:port of the socket data plane, started on the first request that asks for socket lanes;
        "" when this worker runs none (``data_port`` None, or its port could not be opened)."""
        if self.config.data_port is None:
            return ""
        async with self._data_lock:
            if self._data_advertised is None:
                try:
                    server = await serve_socket_lanes(
                        self.lanes, self.config.host, self.config.data_port, self._socket_lane_done
                    )
                except OSError as e:  # e.g. the port is taken: gRPC lanes still work, so serve with those
                    port = self.config.data_port
                    logger.error("socket lanes cannot listen on port %s (%s): gRPC lanes only", port, e)
                    self._data_advertised = ""
                    return ""
                port = server.sockets[0].getsockname()[1]
                self._data_advertised = advertised_endpoint(self.config.host, port, self.config.advertise_host)
                self._data_server = server
                logger.info("socket lanes on %s", self._data_advertised)
            return self._data_advertised

    def _socket_lane_done(self, outcome: str, payload: int) -> None:
        self.metrics.transfer_bytes.inc(payload)
        self.metrics.lane_streams.labels("socket", outcome).inc()

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        if request.HasField("speculative"):
            self.metrics.requests.labels("refused").inc()
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "prefill workers never speculate: the request carries speculative parameters "
                f"(num_speculative_tokens={request.speculative.num_speculative_tokens})",
            )
        diffs = self.fingerprint.differences(fingerprint_from_pb(request.consumer_fingerprint))
        if diffs:
            self.metrics.requests.labels("refused").inc()
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "consumer fingerprint differs from this prefill worker's: " + "; ".join(diffs),
            )
        prompt = list(request.prompt_token_ids)
        try:
            params = dataclasses.replace(params_from_pb(request.params), max_tokens=1)
            self.engine._validate(prompt, params)
        except ValueError as e:
            self.metrics.requests.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        max_bytes = min(request.max_message_bytes or self.config.max_message_bytes, self.config.max_message_bytes)

        data_endpoint = await self._data_endpoint() if request.socket_lanes else ""
        lanes = self.lanes.grant(max(request.lanes, 2) if data_endpoint else request.lanes)
        data_endpoint = data_endpoint if lanes > 1 else ""  # a worker that grants one lane keeps the data
        q = self.aengine.open_stream(rid)
        deliver = self.lanes.open(rid, lanes, lambda chunk: self.aengine.deliver(rid, chunk), bool(data_endpoint))
        self.producer.register(rid, deliver, max_bytes)
        self._outstanding_tokens += len(prompt)
        self.metrics.live_transfers.inc()
        t0 = time.monotonic()
        finished = taps_added = False
        count = StreamCount()  # the Prefill stream's totals, for its end marker
        try:
            cfg = self.engine.model_config
            header = pb.HandoffChunk(
                header=pb.HandoffHeader(
                    producer_fingerprint=fingerprint_to_pb(self.fingerprint),
                    num_prompt_tokens=len(prompt),
                    page_size=self.engine.config.page_size,
                    attention_layers=list(cfg.attention_layers),
                    kda_layers=list(cfg.kda_layers),
                    stage_streams=await self._stages(),
                    lanes=lanes,
                    data_endpoint=data_endpoint,
                )
            )
            yield count.sent(header)
            salt = request.cache_salt
            aux_ids = tuple(request.aux_layer_ids)
            if aux_ids:  # the consumer's drafter reads these; capturing them is not speculating
                await self.aengine.call(lambda e: e.add_aux_layers(aux_ids))
                taps_added = True
            if self.store is not None:  # bring a prefix computed elsewhere into this device's cache
                await self.store.load(self.aengine, prompt, salt)
            await self.aengine.call(lambda e: e.add_request(prompt, params, request_id=rid, cache_salt=salt))
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, RequestOutput):
                    finished = True
                    if item.finish_reason == "abort" or not item.output_token_ids:
                        self.lanes.fail(rid, "its prefill was aborted")
                        await context.abort(grpc.StatusCode.ABORTED, f"prefill of {rid} was aborted")
                    self.lanes.end(rid)  # every kv / state message was dealt before this output
                    self.metrics.ttft.observe(time.monotonic() - t0)
                    ns = namespace(self.namespace_digest, request.cache_salt)
                    hashes = block_hashes(ns, prompt, self.engine.config.page_size)
                    yield count.sent(pb.HandoffChunk(block_hashes=pb.BlockHashes(hashes=hashes)))
                    if aux_ids:
                        for msg in _aux_messages(item, aux_ids, max_bytes):
                            yield count.sent(msg)
                    first = pb.FirstToken(has_logprob=bool(item.logprobs))
                    first.token.token_id = item.output_token_ids[0]
                    if item.logprobs:
                        first.token.CopyFrom(logprobs_to_pb(item.logprobs[0]))
                    yield count.sent(pb.HandoffChunk(first_token=first))
                    yield count.end()
                    self.metrics.requests.labels("ok").inc()
                    self.metrics.transfer_bytes.inc(count.payload)
                    self.metrics.transfer_seconds.observe(time.monotonic() - t0)
                    return
                yield count.sent(item)  # an EncodedChunk from the producer: kv or state
        except asyncio.CancelledError:
            self.metrics.requests.labels("cancelled").inc()
            raise
        finally:
            self.producer.unregister(rid)
            if not finished:
                self.lanes.fail(rid, "the prefill stream ended before the prefill did (cancelled or failed)")
            if taps_added:
                await asyncio.shield(self.aengine.call(lambda e: e.add_aux_layers(aux_ids, remove=True)))
            self._outstanding_tokens -= len(prompt)
            self.metrics.live_transfers.dec()
            if not finished:  # consumer gone, deadline passed, or an error: free the blocks now
                await asyncio.shield(self.aengine.abort(rid))
            else:
                self.aengine.close_stream(rid)

    async def PullLane(self, request: pb.LanePullRequest, context: grpc.aio.ServicerContext):
        """One more data stream of a handoff (engine/kv_transfer/lanes.py)."""
        count, outcome = StreamCount(), "cancelled"
        try:
            async for msg in self.lanes.pull(request.request_id, request.lane, count):
                if isinstance(msg, pb.HandoffChunk):  # the end marker
                    outcome = "ok"
                yield msg
        except LaneRefused as e:
            outcome = "refused"
            await context.abort(e.code, str(e))
        finally:
            self.metrics.transfer_bytes.inc(count.payload)
            self.metrics.lane_streams.labels("grpc", outcome).inc()
