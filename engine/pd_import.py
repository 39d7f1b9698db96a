"""The engine's P/D consumer side: hold pages and a KDA slot for a prompt whose state a producer streams,
then continue the request from the producer's first token. Mixed into LLMEngine, whose attributes it uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.block_hash import namespace
from engine.request import InvalidRequestError, Request, TokenLogprobs
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.cache.tensors import CacheTensors
    from engine.kv_transfer.producer import HandoffProducer
    from engine.outputs import RequestOutput


@dataclass
class ImportReservation:
    """Blocks held for a prompt whose state arrives from a producer (P/D consumer side)."""

    request_id: str
    num_prompt_tokens: int
    page_ids: list[int]
    slot_ids: list[int]


class ImportSide:
    def reserve_import(self, request_id: str, num_prompt_tokens: int) -> ImportReservation | None:
        """Hold pages and a KDA slot for an incoming prompt; None when they are not free now."""
        if request_id in self._requests or request_id in self._reservations:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        busy = len(self.scheduler.running) + len(self.scheduler.waiting) + len(self._reservations)
        if busy >= self.config.max_num_seqs:
            return None
        n_pages = -(-num_prompt_tokens // self.config.page_size)
        # keep room for every running request's next token, so imports never starve decoding
        if not self.pages.can_allocate(n_pages + len(self.scheduler.running)):
            return None
        if self.slots is not None and not self.slots.can_allocate(1):
            return None
        res = ImportReservation(
            request_id,
            num_prompt_tokens,
            self.pages.allocate(n_pages),
            self.slots.allocate(1) if self.slots is not None else [],
        )
        self._reservations[request_id] = res
        return res

    def import_target(self, res: ImportReservation) -> tuple[CacheTensors, list[int], list[int]]:
        """Where a P/D consumer writes the reserved request's pages and state: (cache, page ids, slot
        ids). Here the engine's own cache; a parallel engine stages them and reslices per rank."""
        return self.cache, res.page_ids, res.slot_ids

    def attach_handoff_producer(self, producer: HandoffProducer) -> None:
        """A parallel engine tells its other pipeline stages which requests stream (StepPlan.handoff)."""

    def start_stage_streams(self, host: str, advertise_host: str | None = None) -> list:
        """A pipelined engine's stages > 0 serve their own handoff streams; one stage has none."""
        return []

    def close(self) -> None:
        """Release the engine's processes (a parallel engine's ranks); nothing to do in one process."""

    def release_import(self, res: ImportReservation) -> None:
        if self._reservations.pop(res.request_id, None) is None:
            return
        self.pages.free(res.page_ids)
        if self.slots is not None and res.slot_ids:
            self.slots.free(res.slot_ids)

    def insert_prefilled(
        self,
        res: ImportReservation,
        prompt_ids: list[int],
        params: SamplingParams,
        first_token: int,
        first_logprobs: TokenLogprobs | None,
        cache_salt: str = "",
        aux: torch.Tensor | None = None,
    ) -> RequestOutput:
        """Continue a request from a producer's state: its prompt is cached, its first token sampled."""
        if self._reservations.pop(res.request_id, None) is None:
            raise InvalidRequestError(f"no reservation for request {res.request_id!r}")
        req = Request(res.request_id, prompt_ids, params)
        req.hash_namespace = namespace(self.namespace_digest, cache_salt)
        req.page_ids, req.slot_ids = res.page_ids, res.slot_ids
        req.num_computed_tokens = res.num_prompt_tokens
        if self.prefix_cache is not None:  # the received prompt pages become reusable here too
            filed = self.prefix_cache.file_pages(req, 0, res.num_prompt_tokens)
            for hook in self.filing_hooks:
                hook(filed, [])
        req.output_token_ids.append(first_token)
        if first_logprobs is not None:
            req.output_logprobs.append(first_logprobs)
        self.scheduler.add_running(req)
        if not self.scheduler.finish_if_stopped(req, first_token):
            self._requests[req.request_id] = req
            k = self.spec_k(req)
            if self.drafter is not None and k and (aux is not None or not self.drafter.needs_aux):
                req.draft_tokens = self.drafter.propose(req, k, aux)  # the first decode step already drafts
        return self._output(req)
