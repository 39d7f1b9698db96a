"""The engine: add requests, then ``step()`` schedules, runs the model and post-processes."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from engine.backends import select_backends
from engine.block_hash import namespace
from engine.cache.allocator import BlockAllocator
from engine.cache.budget import cache_budget_bytes, plan_cache
from engine.cache.prefix_cache import PrefixCache
from engine.cache.tensors import CacheLayout, CacheTensors
from engine.config import EngineConfig
from engine.decode_graph import DecodeGraphs, default_batch_sizes
from engine.decode_graph.buffers import PadTargets
from engine.fingerprint import model_digest
from engine.forward_batch import ForwardBatch
from engine.loader import load_model, resolve_dtype
from engine.model_config import load_model_config
from engine.model_runner import ModelRunner
from engine.models.base import CausalLM
from engine.overlap import OverlapDecoder
from engine.request import Request, TokenLogprobs
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import SampleResult, ScheduledChunk, Scheduler, SchedulerOutput
from engine.spec.drafters import build_drafter
from engine.spec.verify import token_logprobs, verify_drafts
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.kv_transfer.producer import HandoffProducer

logger = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """A request the engine refuses; other requests are unaffected."""


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprobs]
    num_preemptions: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0
    aux_hidden: torch.Tensor | None = None
    """The target's taps (aux_layer_ids order) at the position that produced the newest token."""
    aux_layer_ids: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the target's token)."""
        return (self.num_accepted + self.num_verify_steps) / self.num_verify_steps if self.num_verify_steps else 0.0


@dataclass
class ImportReservation:
    """Blocks held for a prompt whose state arrives from a producer (P/D consumer side)."""

    request_id: str
    num_prompt_tokens: int
    page_ids: list[int]
    slot_ids: list[int]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.cpu_threads)
        self.model_config = load_model_config(config.model)
        self.dtype = resolve_dtype(config.dtype, self.model_config)
        self.model = self._load_model()
        self.tokenizer = Tokenizer(config.model)
        layout = self._plan_cache()
        capacity = layout.num_pages * layout.page_size
        self.max_model_len = self._max_model_len(capacity)
        self.cache = self._make_cache(layout)
        self.pages = BlockAllocator("kv pages", layout.num_pages)
        self.slots = BlockAllocator("kda slots", layout.num_slots) if self.model_config.kda_layers else None
        self.prefix_cache: PrefixCache | None = None
        self.namespace_digest = ""
        if config.enable_prefix_caching:
            self.prefix_cache = PrefixCache(self.pages, self.slots, config.page_size, config.kda_checkpoint_pages)
            self.namespace_digest = model_digest(config.model)
        self.scheduler = Scheduler(
            config, self.max_model_len, self.model_config.eos_token_ids, self.pages, self.slots, self.prefix_cache
        )
        self.filing_hooks: list[Callable[[list[tuple[bytes, int]], list[tuple[bytes, int]]], None]] = []
        """Called on the engine thread after each step with the (hash, page) and (hash, slot) filed
        in it, while their contents are still in place (the prefix tier copies them out here)."""
        self.runner = self._make_runner()
        self.drafter = build_drafter(config.speculative, self.model, self.model_config, self.dtype, self.device)
        self.sampler = Sampler(config.seed)
        self.overlap: OverlapDecoder | None = None
        if config.async_scheduling and self.runner.decode_graphs is not None:
            self.overlap = OverlapDecoder(self.runner.decode_graphs, self.scheduler, self.device)
        self._requests: dict[str, Request] = {}
        self._reservations: dict[str, ImportReservation] = {}
        self._aux_requests: dict[int, int] = {}
        self._ids = itertools.count()
        logger.info(
            "cache: %d pages x %d tokens = %d tokens, %d KDA slots, %.1f MiB; max_model_len %d; "
            "%d full-length requests fit at once (max_num_seqs %d)",
            layout.num_pages,
            layout.page_size,
            capacity,
            layout.num_slots,
            self.cache.nbytes() / 2**20,
            self.max_model_len,
            capacity // self.max_model_len,
            config.max_num_seqs,
        )

    # ---- construction steps; a parallel engine (engine/parallel/engine.py) builds one stage's share ----
    def _load_model(self) -> CausalLM:
        model, _ = load_model(self.config.model, self.dtype, self.device, progress=self.config.load_progress)
        model.backends = select_backends(self.device)
        return model

    def _plan_cache(self) -> CacheLayout:
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        budget = cache_budget_bytes(self.config, self.device, weight_bytes)
        return plan_cache(self.model_config, self.config, self.dtype, budget)

    def _make_cache(self, layout: CacheLayout) -> CacheTensors:
        return CacheTensors(self.model_config, layout, self.dtype, self.device)

    def _make_runner(self) -> ModelRunner:
        runner = ModelRunner(self.model, self.cache, self.device, self.config.page_size)
        if self.config.cuda_graphs:
            runner.decode_graphs = self._make_decode_graphs()
        return runner

    def _make_decode_graphs(self) -> DecodeGraphs:
        """Static padded decode steps; one page and one KDA slot are taken for good as padding scratch."""
        pad = PadTargets(
            page=self.pages.allocate(1)[0], slot=self.slots.allocate(1)[0] if self.slots is not None else 0
        )
        sizes = self.config.cuda_graph_batch_sizes or default_batch_sizes(self.config.max_num_seqs)
        return DecodeGraphs(
            self.model,
            self.cache,
            self.device,
            self.config.page_size,
            self.max_model_len,
            pad,
            list(sizes),
            capture=self.device.type == "cuda",
        )

    def _max_model_len(self, capacity_tokens: int) -> int:
        model_max = self.model_config.max_position_embeddings
        want = self.config.max_model_len
        if want is None:
            return min(model_max, capacity_tokens)
        if want > capacity_tokens:
            raise ValueError(
                f"max_model_len={want} exceeds the KV cache capacity of {capacity_tokens} tokens; "
                "raise the cache budget or lower max_model_len"
            )
        return want

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt: list[int] | str,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str = "",
    ) -> str:
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate(ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        req = Request(request_id, ids, params)
        req.hash_namespace = namespace(self.namespace_digest, cache_salt)
        self._requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise InvalidRequestError("prompt is empty: at least one token is required")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids outside the vocabulary [0, {vocab}): {bad[:8]}")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                "(the prompt plus at least one output token must fit)"
            )
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")

    # ---- P/D consumer side ------------------------------------------------------------------
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

    def start_stage_streams(self, host: str) -> list:
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

    def add_aux_layers(self, layer_ids: tuple[int, ...], remove: bool = False) -> None:
        """Producer side: capture these taps too (a consumer's drafter reads them from the handoff)."""
        for t in layer_ids:
            if not -1 <= t < self.model_config.num_hidden_layers:
                raise InvalidRequestError(f"aux layer {t} is outside -1..{self.model_config.num_hidden_layers - 1}")
            self._aux_requests[t] = self._aux_requests.get(t, 0) + (-1 if remove else 1)
            if self._aux_requests[t] <= 0:
                del self._aux_requests[t]
        own = self.drafter.aux_layer_ids if self.drafter is not None and self.drafter.needs_aux else ()
        self.model.aux_layer_ids = tuple(sorted(set(own) | set(self._aux_requests)))

    @property
    def num_outstanding(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting) + len(self._reservations)

    def abort_request(self, request_id: str) -> None:
        req = self.scheduler.abort(request_id)
        if req is not None:
            self._requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or (self.overlap is not None and self.overlap.inflight is not None)

    @torch.inference_mode()
    def prompt_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """Next-token logits [T, V] at every prompt position (prompt scoring), on scratch cache
        blocks that are freed before returning. Runs outside the scheduler: call between steps."""
        self._validate(prompt_ids, SamplingParams())
        req = Request("score", prompt_ids, SamplingParams())
        n_pages = -(-len(prompt_ids) // self.config.page_size)
        if not self.pages.can_allocate(n_pages) or (self.slots is not None and not self.slots.can_allocate(1)):
            raise RuntimeError("no free cache blocks to score the prompt")
        req.page_ids = self.pages.allocate(n_pages)
        req.slot_ids = self.slots.allocate(1) if self.slots is not None else []
        try:
            batch = self.runner.prepare([ScheduledChunk(req, 0, len(prompt_ids))])
            batch.logits_indices = torch.arange(len(prompt_ids), device=batch.input_ids.device)
            return self._score(batch)
        finally:
            self.pages.free(req.page_ids)
            if self.slots is not None:
                self.slots.free(req.slot_ids)

    def _score(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits at batch.logits_indices (a parallel engine runs this on every rank)."""
        hidden = self.model(batch, self.cache)
        return self.model.compute_logits(hidden[batch.logits_indices])

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.overlap is not None and self.overlap.inflight is not None:
            chunks, sampled = self.overlap.advance()  # launches the next step first when it can
            return self._postprocess(SchedulerOutput(chunks), sampled, {})
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        if self.overlap is not None and self.overlap.accepts(sched.chunks):
            self.overlap.start(sched.chunks)
            _, sampled = self.overlap.advance()
            return self._postprocess(sched, sampled, {})
        sampled, aux_rows = self._execute(sched)
        return self._postprocess(sched, sampled, aux_rows)

    def _postprocess(
        self, sched: SchedulerOutput, sampled: dict[str, SampleResult], aux_rows: dict[str, int]
    ) -> list[RequestOutput]:
        updated = self.scheduler.postprocess(sched, sampled)
        if self.scheduler.filed_pages or self.scheduler.filed_checkpoints:
            pages, ckpts = self.scheduler.filed_pages, self.scheduler.filed_checkpoints
            self.scheduler.filed_pages, self.scheduler.filed_checkpoints = [], []
            for hook in self.filing_hooks:
                hook(pages, ckpts)
        if self.model.aux_layer_ids and self.model.aux_states is not None:
            by_id = {r.request_id: r for r in updated}
            for rid, row in aux_rows.items():
                if rid in by_id:
                    by_id[rid].last_aux = self.model.aux_states[row].clone()
                    by_id[rid].last_aux_layers = self.model.aux_layer_ids
        if self.drafter is not None:
            self._draft(aux_rows)
        outputs = [self._output(r) for r in updated]
        for r in updated:
            if r.is_finished:
                self._requests.pop(r.request_id, None)
        return outputs

    def _execute(self, sched: SchedulerOutput) -> tuple[dict[str, SampleResult], dict[str, int]]:
        """Run the scheduled chunks and sample (or verify drafts): per sampling request its result,
        and the logits row where the drafter reads the target's aux states."""
        for c in sched.chunks:  # state fork: a prefix hit's checkpoint becomes the request's own state
            if c.request.fork_slot is not None:
                self.cache.copy_slot(c.request.fork_slot, c.request.slot_ids[0])
                self.slots.free([c.request.fork_slot])
                c.request.fork_slot = None
        logits = self.runner.execute(sched.chunks)
        return self._sample(sched.chunks, logits)

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> tuple[dict, dict]:
        """Sample (or verify drafts) per sampling chunk; also the row of each request's last accepted
        position, where the drafter reads the target's aux states."""
        sampled: dict[str, SampleResult] = {}
        aux_rows: dict[str, int] = {}
        plain: list[tuple[Request, int]] = []  # (request, its logits row): sampled in one call below
        row = 0
        for c in chunks:
            if not c.samples:
                continue
            req = c.request
            if c.drafts:
                rows = logits[row : row + 1 + len(c.drafts)].float().cpu()
                tokens, accepted = verify_drafts(rows, list(c.drafts), req, self.sampler._rng)
                n_top = req.params.logprobs
                lps = token_logprobs(rows, tokens, n_top) if n_top is not None else []
                sampled[req.request_id] = SampleResult(tokens, lps, accepted)
                aux_rows[req.request_id] = row + accepted
            else:
                plain.append((req, row))
                aux_rows[req.request_id] = row
            row += 1 + len(c.drafts)
        if plain:
            rows = [r for _, r in plain]
            if rows != list(range(logits.shape[0])):  # drafts' rows in between: pick the plain ones
                logits = logits[torch.tensor(rows, device=logits.device)]
            drawn = self.sampler.sample(logits, [req for req, _ in plain])
            for (req, _), (token, lp) in zip(plain, drawn, strict=True):
                sampled[req.request_id] = SampleResult([token], [lp] if lp is not None else [])
        return sampled, aux_rows

    def _draft(self, aux_rows: dict[str, int]) -> None:
        """Propose the next step's drafts for every decoding request with speculation on."""
        aux = self.model.aux_states
        for req in self.scheduler.running:
            k = self.spec_k(req)
            if k == 0 or req.num_computed_tokens != req.num_tokens - 1:
                req.draft_tokens = []
                continue
            if self.drafter.needs_aux:
                row = aux_rows.get(req.request_id)
                if row is None:  # not scheduled this step: its drafts are still valid
                    continue
                req.draft_tokens = self.drafter.propose(req, k, aux[row])
            else:
                req.draft_tokens = self.drafter.propose(req, k)

    def spec_k(self, req: Request) -> int:
        k = self.config.speculative.num_speculative_tokens
        if req.params.num_speculative_tokens is not None:
            k = min(k, req.params.num_speculative_tokens)
        return k

    @staticmethod
    def _output(r: Request) -> RequestOutput:
        return RequestOutput(
            r.request_id,
            r.prompt_token_ids,
            list(r.output_token_ids),
            r.is_finished,
            r.finish_reason,
            list(r.output_logprobs),
            r.num_preemptions,
            r.num_drafted,
            r.num_accepted,
            r.num_verify_steps,
            r.last_aux,
            r.last_aux_layers,
        )

    def generate(
        self,
        prompts: list[list[int]] | list[str],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        order: list[str] = []
        try:
            for p, sp in zip(prompts, plist, strict=True):
                order.append(self.add_request(p, sp))
        except Exception:  # all or nothing: don't leave earlier prompts running under unseen ids
            for rid in order:
                self.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="Generating", disable=not use_tqdm)
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in order]
