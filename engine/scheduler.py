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
from engine.cache.prefix_cache import PrefixCache, PrefixHit
from engine.config import EngineConfig
from engine.request import Request, RequestStatus, TokenLogprobs


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int
    """Tokens already cached before this step."""
    num_tokens: int
    checkpoints: tuple[tuple[int, int], ...] = ()
    """(position, slot): KDA state after that many tokens goes to that slot this step (rungs and
    the per-draft-position states of a verify step)."""
    drafts: tuple[int, ...] = ()
    """Draft tokens verified in this step (their positions follow the request's last token)."""
    spec_slots: tuple[int, ...] = ()
    """spec_slots[j]: KDA state after the last token and drafts[:j+1] (for rollback)."""

    @property
    def samples(self) -> bool:
        """This chunk reaches the request's last known token, so it produces the next one."""
        return self.start + self.num_tokens - len(self.drafts) == self.request.num_tokens


@dataclass(frozen=True)
class SampleResult:
    tokens: list[int]
    """Tokens to append: one, or the accepted drafts plus the target's token."""
    logprobs: list[TokenLogprobs]
    num_accepted: int = 0


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
        prefix: PrefixCache | None = None,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.pages = pages
        self.slots = slots
        self.prefix = prefix
        self.filed_pages: list[tuple[bytes, int]] = []
        self.filed_checkpoints: list[tuple[bytes, int]] = []
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
            if req.pending_checkpoints:  # checkpoint hold: never run ahead of an unfiled rung
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts = self._drafts_for(req, n, budget - n)
            while not self._reserve_pages(req, req.num_computed_tokens + n + len(drafts)):
                if drafts:  # give up speculation before preempting anyone
                    drafts = []
                    continue
                victim = self.running.pop()  # youngest first
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                chunk = self._chunk(req, n, drafts)
                out.chunks.append(chunk)
                budget -= chunk.num_tokens
                i += 1
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            req = self.waiting[0]
            if self.slots is not None and not self.slots.can_allocate(1):
                break
            hit = self._match_prefix(req)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._reserve_pages(req, req.num_computed_tokens + n):
                if hit is not None:
                    self._undo_match(req, hit)
                break
            if self.slots is not None:
                req.slot_ids = self.slots.allocate(1)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(self._chunk(req, n))
            budget -= n
        return out

    def _match_prefix(self, req: Request) -> PrefixHit | None:
        if self.prefix is None or req.num_computed_tokens or req.page_ids:
            return None
        hit = self.prefix.match(req)
        req.page_ids = list(hit.pages)
        req.num_computed_tokens = hit.resume_tokens
        req.kv_cached_tokens = hit.kv_tokens
        req.fork_slot = hit.checkpoint_slot
        req.prefix_hit_tokens = hit.kv_tokens
        return hit

    def _undo_match(self, req: Request, hit: PrefixHit) -> None:
        self.pages.free(req.page_ids)  # the hit's shared pages plus any reserved after them
        if hit.checkpoint_slot is not None:
            self.slots.free([hit.checkpoint_slot])
        req.page_ids, req.fork_slot = [], None
        req.num_computed_tokens = req.kv_cached_tokens = req.prefix_hit_tokens = 0

    def _drafts_for(self, req: Request, n: int, budget_left: int) -> list[int]:
        """The request's drafts, if it is decoding and they fit the budget and its limits."""
        if not req.draft_tokens or n != 1 or req.num_computed_tokens != req.num_tokens - 1:
            return []
        room = min(
            budget_left,
            req.params.max_tokens - len(req.output_token_ids) - 1,
            self.max_model_len - req.num_tokens - 1,
        )
        return req.draft_tokens[: max(room, 0)]

    def _chunk(self, req: Request, n: int, drafts: list[int] | None = None) -> ScheduledChunk:
        start = req.num_computed_tokens
        drafts = list(drafts or [])
        spec_slots: list[int] = []
        if drafts and self.slots is not None:  # one state slot per draft position, for rollback
            k = min(len(drafts), self.slots.num_free)
            drafts, spec_slots = drafts[:k], self.slots.allocate(k)
        cks: list[tuple[int, int]] = []
        if self.prefix is not None and self.slots is not None:
            for pos in self.prefix.rungs_in(start, start + n + len(drafts)):
                if not self.prefix.checkpoint_exists(req, pos) and self.slots.can_allocate(1):
                    cks.append((pos, self.slots.allocate(1)[0]))
        req.pending_checkpoints = cks
        spec_cks = [(start + n + j, slot) for j, slot in enumerate(spec_slots)]
        return ScheduledChunk(req, start, n + len(drafts), tuple(cks + spec_cks), tuple(drafts), tuple(spec_slots))

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
        if self.slots is not None:
            held = req.slot_ids + [s for _, s in req.pending_checkpoints]
            if req.fork_slot is not None:
                held.append(req.fork_slot)
            self.slots.free(held)
        req.slot_ids, req.pending_checkpoints, req.fork_slot = [], [], None
        req.kv_cached_tokens = 0

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.draft_tokens = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the model ran ----------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: dict[str, SampleResult]) -> list[Request]:
        """Advance progress, append sampled tokens, finish requests. Returns requests with news."""
        updated = []
        for chunk in out.chunks:
            req = chunk.request
            if req.is_finished:  # aborted while the step ran
                if self.slots is not None:
                    self.slots.free(list(chunk.spec_slots))
                continue
            result = sampled.get(req.request_id) if chunk.samples else None
            if chunk.drafts:
                self._settle_verify(req, chunk, result)
            else:
                req.num_computed_tokens += chunk.num_tokens
            if self.prefix is not None:
                self._file(req, chunk)
            if result is None:
                continue
            for j, token in enumerate(result.tokens):
                req.output_token_ids.append(token)
                if j < len(result.logprobs):
                    req.output_logprobs.append(result.logprobs[j])
                reason = self._stop_reason(req, token)
                if reason is not None:
                    self._finish(req, reason)
                    break
            updated.append(req)
        return updated

    def _settle_verify(self, req: Request, chunk: ScheduledChunk, result: SampleResult) -> None:
        """Keep the accepted drafts: progress, KDA state (rollback) and the acceptance counts."""
        k, a = len(chunk.drafts), result.num_accepted
        req.num_computed_tokens = chunk.start + chunk.num_tokens - k + a
        spec = list(chunk.spec_slots)
        if a < k and spec:  # the state after the last accepted token becomes the running state
            req.slot_ids[0], spec[a] = spec[a], req.slot_ids[0]
        if self.slots is not None:
            self.slots.free(spec)
        req.num_drafted += k
        req.num_accepted += a
        req.num_verify_steps += 1

    def _file(self, req: Request, chunk: ScheduledChunk) -> None:
        """File what this step completed: full pages, then the rung checkpoints (releasing the hold).
        Rungs past the accepted tokens of a verify step are dropped, never filed."""
        self.filed_pages += self.prefix.file_pages(req, chunk.start, req.num_computed_tokens)
        for pos, slot in req.pending_checkpoints:
            h = self.prefix.file_checkpoint(req, pos, slot) if pos <= req.num_computed_tokens else None
            if pos > req.num_computed_tokens:
                self.slots.free([slot])
            if h is not None:
                self.filed_checkpoints.append((h, slot))
        req.pending_checkpoints = []

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
