"""P/D handoff from a pipelined prefill worker: every stage streams its own layers to the decode side.

A prefill worker with pp > 1 stages holds each layer's pages and KDA state on the stage that owns the
layer. Stages > 0 do not relay through rank 0: each stage leader runs a small gRPC server
(``tandem.v1.PrefillStage/Pull``) and the worker's Prefill stream announces those endpoints in its header,
so the decode side pulls every stage's share directly while rank 0 streams stage 0's.

    rank 0 (Prefill stream)          header{stage_streams} . stage-0 kv/state ... first_token . end
    stage s leader (Pull stream)     stage-s kv/state ...                                      . end

On a stage leader the producer's layer hook puts each finished message into the request's ``StageOutbox``
box during the step (the engine thread); the Pull handler (a gRPC thread) sends from the box. The stage
follows rank 0's registrations (``StepPlan.handoff``): a request whose prompt completes on this stage gets
its end marker after that step; a request rank 0 drops before that (cancelled, failed) gets an error. A
box nobody pulls is dropped after ``ttl_s``; a puller waits for its box until its own deadline.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from engine.cache.tensors import CacheTensors
from engine.kv_transfer.producer import HandoffProducer
from engine.kv_transfer.wire import EncodedChunk, StreamCount, serialize_chunk
from engine.model_config import ModelConfig
from engine.parallel.plan import StepPlan
from tandem.rpc import prefill_pb2 as pb

logger = logging.getLogger(__name__)

POLL_S = 0.25
"""How often a waiting Pull handler checks that its client is still there."""


@dataclass(frozen=True)
class StageEnd:
    """Sent after the step that completed the request's prompt on this stage."""


@dataclass(frozen=True)
class StageFailed:
    reason: str


@dataclass
class _Box:
    items: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    created: float = field(default_factory=time.monotonic)
    closed: bool = False  # an end marker or an error was put
    pulled: bool = False


class StageOutbox:
    """Per request, the messages this stage produced and not yet sent; thread-safe."""

    def __init__(self, ttl_s: float = 60.0) -> None:
        self.ttl_s = ttl_s
        self._boxes: dict[str, _Box] = {}
        self._lock = threading.Lock()

    def box(self, rid: str, pulling: bool = False) -> _Box:
        with self._lock:
            b = self._boxes.setdefault(rid, _Box())
            b.pulled |= pulling
            return b

    def put(self, rid: str, item: EncodedChunk | StageEnd | StageFailed) -> None:
        b = self.box(rid)
        if not b.closed:
            b.closed = not isinstance(item, EncodedChunk)
            b.items.put(item)

    def drop(self, rid: str) -> None:
        with self._lock:
            self._boxes.pop(rid, None)

    def sweep(self) -> None:
        """Forget boxes nobody pulled within ttl_s (a consumer that never came, or went away)."""
        now = time.monotonic()
        with self._lock:
            for rid in [r for r, b in self._boxes.items() if not b.pulled and now - b.created > self.ttl_s]:
                del self._boxes[rid]

    def __len__(self) -> int:
        with self._lock:
            return len(self._boxes)


class StageProducer:
    """A stage leader's side of the handoff: its producer, its outbox, and its Pull server."""

    def __init__(self, cfg: ModelConfig, cache: CacheTensors, page_size: int, stage: int) -> None:
        self.stage = stage
        self.producer = HandoffProducer(cfg, cache, page_size)
        self.outbox = StageOutbox()
        self.active: set[str] = set()
        self.server: grpc.Server | None = None

    def start(self, host: str, advertise_host: str | None = None) -> str:
        from tandem.grpc_util import SERVER_OPTIONS, advertised_endpoint  # only a prefill worker's stages need it

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=SERVER_OPTIONS)
        handler = grpc.unary_stream_rpc_method_handler(
            self._pull, request_deserializer=pb.StagePullRequest.FromString, response_serializer=serialize_chunk
        )
        name = pb.DESCRIPTOR.services_by_name["PrefillStage"].full_name
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, {"Pull": handler}),))
        port = self.server.add_insecure_port(f"{host}:0")
        self.server.start()
        return advertised_endpoint(host, port, advertise_host)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=1.0)

    # ---- the engine thread, around every step ----------------------------------------------------------
    def begin(self, streams: dict[str, int]) -> None:
        """Follow rank 0's registrations: its producer lists every request streaming right now."""
        for rid in self.active - streams.keys():  # gone on rank 0 before its prompt completed here
            self.producer.unregister(rid)
            self.outbox.put(rid, StageFailed(f"the prefill of {rid} ended on the worker before stage {self.stage}"))
        for rid, max_bytes in streams.items():
            if rid not in self.active:
                self.producer.register(rid, self._sink(rid), max_bytes)
        self.active = set(streams)
        self.outbox.sweep()

    def end_step(self, plan: StepPlan) -> None:
        """Requests whose prompt completed in this step have sent everything of this stage: end them."""
        self.producer.flush()  # their last messages are in the outbox before the end marker
        batch = plan.batch
        for rid, done in zip(batch.request_ids, batch.completes_prompt or [], strict=False):
            if done and rid in self.active:
                self.producer.unregister(rid)
                self.active.discard(rid)
                self.outbox.put(rid, StageEnd())

    def _sink(self, rid: str):
        return lambda chunk: self.outbox.put(rid, chunk)

    # ---- a gRPC thread, per pull -----------------------------------------------------------------------
    def _pull(self, request: pb.StagePullRequest, context: grpc.ServicerContext):
        rid = request.request_id
        if request.stage != self.stage:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"this is stage {self.stage}, not {request.stage}")
        box = self.outbox.box(rid, pulling=True)
        count = StreamCount()
        try:
            while True:
                try:
                    item = box.items.get(timeout=POLL_S)
                except queue.Empty:
                    if not context.is_active():
                        return
                    continue
                if isinstance(item, StageFailed):
                    context.abort(grpc.StatusCode.ABORTED, item.reason)
                if isinstance(item, StageEnd):
                    yield count.end()
                    return
                yield count.sent(item)
        finally:
            self.outbox.drop(rid)


@dataclass(frozen=True)
class StageEndpoint:
    stage: int
    endpoint: str
    layers: tuple[int, ...]


def start_stage_streams(state, host: str, advertise_host: str | None = None) -> StageEndpoint | None:
    """Run on every rank (``collective_call``): stage leaders > 0 start producing and serving."""
    g = state.groups
    if not g.is_stage_leader or g.is_first_stage or state.relay is not None:
        return None
    from engine.model_config import load_model_config

    cfg = load_model_config(state.config.model)
    relay = StageProducer(cfg, state.cache, state.config.page_size, g.stage)
    endpoint = relay.start(host, advertise_host)
    state.stage.model.layer_hooks.append(relay.producer.on_layer)
    state.relay = relay
    logger.info("stage %d serves its handoff streams on %s", g.stage, endpoint)
    return StageEndpoint(g.stage, endpoint, tuple(state.stage.layers))
