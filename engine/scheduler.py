"""Continuous batching: which requests run this step, and how many of their tokens.

Every step has a token budget (``max_num_batched_tokens``). Running requests are served first,
in arrival order: a decoding request takes one token, a prefilling one takes the next chunk of its
prompt. Leftover budget admits waiting requests. When pages run out, the youngest running request
is preempted: its pages and slots are freed and it is recomputed later from its tokens so far.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.cache.allocator import BlockAllocator
from engine.config import EngineConfig
from engine.request import Request, RequestStatus, TokenLogprobs


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int
    """Tokens already cached before this step."""
    num_tokens: int

    @property
    def samples(self) -> bool:
        """This chunk reaches the request's last known token, so it produces the next one."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        pages: BlockAllocator,
        slots: BlockAllocator | None,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.pages = pages
        self.slots = slots
        self.page_size = config.page_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """A request whose prompt is already in the caches (P/D consumer)."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def finish_if_stopped(self, req: Request, token: int) -> bool:
        reason = self._stop_reason(req, token)
        if reason is not None:
            self._finish(req, reason)
        return reason is not None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Request | None:
        for req in [*self.running, *self.waiting]:
            if req.request_id == request_id:
                self._finish(req, "abort")
                return req
        return None

    # ---- schedule -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._reserve_pages(req, req.num_computed_tokens + n):
                victim = self.running.pop()  # youngest first
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
                budget -= n
                i += 1
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self.slots is not None and not self.slots.can_allocate(1):
                break
            if not self._reserve_pages(req, req.num_computed_tokens + n):
                break
            if self.slots is not None:
                req.slot_ids = self.slots.allocate(1)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
        return out

    def _reserve_pages(self, req: Request, num_tokens: int) -> bool:
        need = -(-num_tokens // self.page_size) - len(req.page_ids)
        if need <= 0:
            return True
        if not self.pages.can_allocate(need):
            return False
        req.page_ids.extend(self.pages.allocate(need))
        return True

    def _release(self, req: Request) -> None:
        self.pages.free(req.page_ids)
        req.page_ids = []
        if self.slots is not None and req.slot_ids:
            self.slots.free(req.slot_ids)
        req.slot_ids = []

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the model ran ----------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: dict[str, tuple[int, TokenLogprobs | None]]) -> list[Request]:
        """Advance progress, append sampled tokens, finish requests. Returns requests with news."""
        updated = []
        for chunk in out.chunks:
            req = chunk.request
            if req.is_finished:  # aborted while the step ran
                continue
            req.num_computed_tokens += chunk.num_tokens
            if not chunk.samples:
                continue
            token, logprobs = sampled[req.request_id]
            req.output_token_ids.append(token)
            if logprobs is not None:
                req.output_logprobs.append(logprobs)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self._finish(req, reason)
            updated.append(req)
        return updated

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
