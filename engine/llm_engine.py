"""The engine: add requests, then ``step()`` schedules, runs the model and post-processes."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import numpy as np
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
from engine.fingerprint import model_digest
from engine.forward_batch import ForwardBatch
from engine.loader import load_model, resolve_dtype
from engine.model_config import load_model_config
from engine.model_runner import ModelRunner
from engine.models.base import CausalLM, pack_for_device
from engine.outputs import RequestOutput, request_output
from engine.overlap import OverlapDecoder
from engine.pad_targets import PadTargets
from engine.pd_import import ImportReservation, ImportSide
from engine.prefill_graph import PrefillGraphs, default_token_buckets
from engine.request import InvalidRequestError, Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import SampleResult, ScheduledChunk, Scheduler, SchedulerOutput
from engine.spec.drafters import build_drafter
from engine.spec.verify import token_logprobs, verify_drafts
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LLMEngine(ImportSide):
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
        self.before_output_hooks: list[Callable[[], None]] = []
        """Run after a step's forward, before its outputs are made (a P/D producer flushes its messages)."""
        """Called on the engine thread after each step with the (hash, page) and (hash, slot) filed
        in it, while their contents are still in place (the prefix tier copies them out here)."""
        self.scratch: PadTargets | None = None
        """The page and KDA slot the graph paths' padding rows use (taken for good with cuda_graphs)."""
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
        pack_for_device(model, self.device)
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
            # one page and one KDA slot are taken for good as the padding rows' scratch (both kinds of graph)
            pad = self.scratch = PadTargets(
                page=self.pages.allocate(1)[0], slot=self.slots.allocate(1)[0] if self.slots is not None else 0
            )
            runner.decode_graphs = self._make_decode_graphs(pad)
            max_tokens = min(self.config.prefill_graph_max_tokens, self.config.max_num_batched_tokens)
            if max_tokens > 0:
                runner.prefill_graphs = PrefillGraphs(
                    self.model,
                    self.cache,
                    self.device,
                    self.config.page_size,
                    pad,
                    default_token_buckets(max_tokens),
                    capture=self.device.type == "cuda",
                    max_layouts=self.config.prefill_layout_graphs,
                )
        return runner

    def _make_decode_graphs(self, pad: PadTargets) -> DecodeGraphs:
        """Static padded decode steps."""
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
        array = self._validate(ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        # from the array: Python ints even where numpy ints or bools were passed (outputs serialise them)
        req = Request(request_id, array.tolist(), params, prompt_array=array)
        req.hash_namespace = namespace(self.namespace_digest, cache_salt)
        self._requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def _validate(self, ids: list[int], params: SamplingParams) -> np.ndarray:
        """Raise InvalidRequestError on a bad request; else the prompt as int64 numpy (prepare slices it)."""
        if not ids:
            raise InvalidRequestError("prompt is empty: at least one token is required")
        vocab = self.model_config.vocab_size
        # C-speed check first: one conversion to numpy, reused by prepare (an 8k prompt: ~0.18 ms, vs ~0.31 ms
        # for a type set and min / max over the list, then ~0.13 ms more to convert it in prepare); the exact
        # per-token check only when it fails (a float, str or out-of-range id: a non-integer array or the range)
        try:
            array = np.asarray(ids)
        except (ValueError, TypeError):  # ragged: a list inside the prompt
            array = np.zeros(0, dtype=np.int64)
        fast_ok = array.ndim == 1 and len(array) == len(ids) and array.dtype.kind in "iub"
        fast_ok = fast_ok and array.min() >= 0 and array.max() < vocab
        bad = [] if fast_ok else [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids outside the vocabulary [0, {vocab}): {bad[:8]}")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                "(the prompt plus at least one output token must fit)"
            )
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        return array.astype(np.int64, copy=False)

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

    @torch.inference_mode()
    def capture_graphs(self) -> int:
        """Capture the piecewise prefill graphs of every token bucket now, as vLLM does at startup, instead of
        on each bucket's first step (whose request would wait for two warm-up forwards and the capture). Call
        it once the layer hooks are in place (the P/D producer's; a change of hooks captures again). Decode
        graphs stay lazy (one per batch size and context bucket). With KDA layers, also a long prompt's full
        chunks with their KDA cores inside the graphs (engine/prefill_graph/layouts.py). Returns the buckets
        captured."""
        graphs = self.runner.prefill_graphs
        return 0 if graphs is None else graphs.capture_all(full_chunk=self.config.max_num_batched_tokens)

    @property
    def pages_in_use(self) -> int:
        """KV pages held for requests (not the padding scratch page)."""
        return self.pages.num_used - (self.scratch is not None)

    @property
    def slots_in_use(self) -> int:
        """KDA slots held for requests (not the padding scratch slot)."""
        return 0 if self.slots is None else self.slots.num_used - (self.scratch is not None)

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
        for hook in self.before_output_hooks:
            hook()
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
        return request_output(r)

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
