"""The router's public gRPC API: tandem.v1.Router/Generate (server streaming)."""

from __future__ import annotations

import uuid

import grpc

from engine.tokenizer import Tokenizer
from router.backend import GenerationBackend, GenerationError, GenerationRequest, SpeculativeParams
from router.detokenizer import IncrementalDetokenizer
from tandem.convert import logprobs_to_pb, params_from_pb
from tandem.rpc import router_pb2 as pb
from tandem.rpc import router_pb2_grpc

_GRPC_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    499: grpc.StatusCode.CANCELLED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, backend: GenerationBackend, tokenizer: Tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        which = request.WhichOneof("prompt")
        if which is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is required (text or token_ids)")
        ids = self.tokenizer.encode(request.text) if which == "text" else list(request.token_ids.ids)
        if not ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
        if any(t >= self.vocab_size for t in ids):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"token ids outside the vocabulary [0, {self.vocab_size})"
            )
        if len(ids) >= self.max_model_len:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}"
            )
        try:
            if not request.params.max_tokens:
                request.params.max_tokens = self.max_model_len - len(ids)
            params = params_from_pb(request.params)
            spec = (
                SpeculativeParams(request.speculative.num_speculative_tokens)
                if request.HasField("speculative")
                else None
            )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
        gen = self.backend.generate(GenerationRequest(rid, ids, params, spec, context.time_remaining()))
        detok = IncrementalDetokenizer(self.tokenizer)
        completion = 0
        try:
            async for ev in gen:
                completion += len(ev.token_ids)
                text = detok.add(ev.token_ids) + (detok.finish() if ev.finished else "")
                yield pb.GenerateResponse(
                    request_id=rid,
                    token_ids=ev.token_ids,
                    logprobs=[logprobs_to_pb(lp) for lp in ev.logprobs],
                    text=text,
                    finished=ev.finished,
                    finish_reason=ev.finish_reason or "",
                    prompt_tokens=len(ids),
                    completion_tokens=completion,
                )
        except GenerationError as e:
            await context.abort(_GRPC_STATUS.get(e.code, grpc.StatusCode.INTERNAL), str(e))
        finally:
            await gen.aclose()
