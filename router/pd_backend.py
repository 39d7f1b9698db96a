"""The serving backend behind the router's front ends: pick a prefill and a decode worker, ask the
decode worker to pull from the prefill worker, relay its token stream."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from engine.block_hash import block_hashes, namespace
from kvstore.index import IndexUnavailableError, PrefixIndex
from router.backend import GenerationError, GenerationRequest, TokenEvent
from router.workers import Worker, WorkerRegistry
from tandem.convert import logprobs_from_pb, params_to_pb
from tandem.rpc import common_pb2 as cpb
from tandem.rpc import decode_pb2, prefill_pb2

logger = logging.getLogger(__name__)

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 500,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.DATA_LOSS: 502,
    grpc.StatusCode.CANCELLED: 499,
}


def build_prefill_request(req: GenerationRequest) -> prefill_pb2.PrefillRequest:
    """What a prefill worker gets: the prompt and first-token sampling, never speculative settings."""
    return prefill_pb2.PrefillRequest(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        params=params_to_pb(req.params),
        cache_salt=req.cache_salt,
    )


def build_decode_request(req: GenerationRequest, prefill_endpoint: str) -> decode_pb2.DecodeRequest:
    m = decode_pb2.DecodeRequest(
        request_id=req.request_id,
        params=params_to_pb(req.params),
        prefill_endpoint=prefill_endpoint,
        prefill=build_prefill_request(req),
    )
    if req.speculative is not None:
        m.speculative.CopyFrom(cpb.SpeculativeParams(num_speculative_tokens=req.speculative.num_speculative_tokens))
    return m


class PDBackend:
    def __init__(self, registry: WorkerRegistry, index: PrefixIndex | None = None) -> None:
        self.registry = registry
        self.index = index
        self.routed_by_prefix = 0
        self.prefix_fallbacks = 0
        """Requests routed by load only although prefix routing is on (no hit, or the index failed)."""

    async def _pick_prefill(self, req: GenerationRequest) -> Worker:
        """Least (tokens left to compute + tokens already queued): a long resident prefix wins unless
        that worker is busy enough to lose its advantage."""
        workers = self.registry.prefill
        if self.index is None or len(workers) < 2:
            return self.registry.pick_prefill()
        info = workers[0].info.fingerprint
        ps = info.page_size
        ids = req.prompt_token_ids
        hashes = block_hashes(namespace(info.model_digest, req.cache_salt), ids[: len(ids) - 1], ps)
        try:
            hits = await asyncio.to_thread(lambda: [self.index.resident_prefix(w.endpoint, hashes) for w in workers])
        except IndexUnavailableError as e:
            logger.warning("prefix routing falls back to load: %s", e)
            self.prefix_fallbacks += 1
            return self.registry.pick_prefill()
        if not any(hits):
            self.prefix_fallbacks += 1
            return self.registry.pick_prefill()
        self.routed_by_prefix += 1
        costs = [
            (len(ids) - hit * ps + w.outstanding_tokens, i)
            for i, (w, hit) in enumerate(zip(workers, hits, strict=True))
        ]
        return workers[min(costs)[1]]

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        p = await self._pick_prefill(req)
        d = self.registry.pick_decode()
        n = len(req.prompt_token_ids)
        p.outstanding_tokens += n
        p.outstanding_requests += 1
        d.outstanding_requests += 1
        prefill_pending = True
        call = d.stub.Generate(build_decode_request(req, p.endpoint), timeout=req.deadline_s)
        try:
            async for chunk in call:
                if prefill_pending:
                    prefill_pending = False
                    p.outstanding_tokens -= n
                    p.outstanding_requests -= 1
                yield TokenEvent(
                    token_ids=list(chunk.token_ids),
                    logprobs=[logprobs_from_pb(x) for x in chunk.logprobs],
                    finished=chunk.finished,
                    finish_reason=chunk.finish_reason or None,
                )
                if chunk.finished:
                    return
            raise GenerationError(f"decode worker {d.endpoint} ended the stream before the request finished", 502)
        except grpc.aio.AioRpcError as e:
            status = _HTTP_STATUS.get(e.code(), 500)
            raise GenerationError(f"{e.details()} (decode worker {d.endpoint}: {e.code().name})", status) from e
        finally:
            call.cancel()  # client gone or done: cancels the decode stream, which cancels the prefill
            if prefill_pending:
                p.outstanding_tokens -= n
                p.outstanding_requests -= 1
            d.outstanding_requests -= 1
