"""Steps the decode graphs do not take (prefill, mixed, verify), padded to a token bucket and run as pieces.

A step's T rows are padded up to the next bucket; the padding rows take token 0 at position 0, flow through
the row-wise pieces like any row and are never handed to a core (cores see the first T rows), so they read no
key, write no page or slot, and their core outputs are zero rows. One capture per bucket, lazily on its first
step: two eager warm-up runs of the padded forward (Triton autotuning, cuBLAS workspaces), then the capture,
whose cores run on a batch that writes nothing but the padding scratch slot — or all buckets at once, at
startup (``capture_all``, what the workers do: no request waits for a capture). The model's layer hooks and
backends are captured with the pieces (boundaries and calls, kernels): when either changes, every bucket is
captured again. A capture that fails turns the pieces off for good with a warning; steps then run the normal
eager path.

On the host (no CUDA) the same padded forward runs eagerly with the cores cut out of it (``EagerRun``): what
the CPU tests compare with the normal path, token for token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from engine.cache.tensors import CacheTensors
from engine.forward_batch import ForwardBatch
from engine.models.base import CausalLM
from engine.pad_targets import PadTargets
from engine.prefill_graph.layouts import DEFAULT_MAX_LAYOUTS, KDALayout, LayoutBook, capture_batch
from engine.prefill_graph.pieces import CaptureRun, EagerRun, Pieces, Run, split_backends
from engine.scheduler import ScheduledChunk

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 8192
"""Largest bucket by default: above it a step's kernels outlast its launches (32k prefill on the H200: 173 ms
of kernels against 66 ms of host), and a bucket's graph pool holds a forward's activations."""


def default_token_buckets(max_tokens: int) -> list[int]:
    """16 .. 512 by powers of two, then every 256 up to 2048, then every 1024: padding at most ~50 % below 512
    tokens (where the launches, not the rows, are the cost), 12.5 % up to 2k, 33 % at 3k and less above."""
    sizes = [16, 32, 64, 128, 256, 512, *range(768, 2049, 256), *range(3072, max(max_tokens, 3072) + 1, 1024)]
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


class PrefillGraphs:
    def __init__(
        self,
        model: CausalLM,
        cache: CacheTensors,
        device: torch.device,
        page_size: int,
        pad: PadTargets,
        buckets: list[int],
        capture: bool,
        max_layouts: int = DEFAULT_MAX_LAYOUTS,
    ) -> None:
        self.model, self.cache, self.device, self.page_size, self.pad = model, cache, device, page_size, pad
        self.buckets = sorted(buckets)
        top = self.buckets[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.capture = capture and device.type == "cuda"
        self.enabled = True
        """Runtime switch (benchmarks compare the pieces with the eager step on one engine)."""
        self._pieces: dict[int | tuple, Pieces] = {}
        """By bucket, and by (bucket, layout key) for the layouts with their KDA cores inside (layouts.py)."""
        self.layouts = LayoutBook(max_layouts if cache.recurrent else 0)
        self._captured_with: tuple = (None, ())
        """The model's backends and layer hooks the pieces were captured with: their kernels, core calls and
        hook boundaries are in the pieces."""
        self._batches: dict[int, ForwardBatch] = {}
        self._pool: Any = None
        self.counts = {
            "graph_steps": 0,
            "eager_padded_steps": 0,
            "padded_rows": 0,
            "captures": 0,
            "layout_steps": 0,
            "layout_captures": 0,
        }

    def accepts(self, chunks: list[ScheduledChunk]) -> bool:
        if not self.enabled or not chunks or self.model.aux_layer_ids:
            return False  # drafter taps index the rows of the whole forward: the eager path
        return sum(c.num_tokens for c in chunks) <= self.buckets[-1]

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Final-normed hidden states of the step's rows [T, hidden] (a view into a pool buffer on the graph
        path: valid until the next step)."""
        n = batch.num_tokens
        bucket = next(b for b in self.buckets if b >= n)
        self.counts["padded_rows"] += bucket - n
        self._fill(batch, n, bucket)
        if self.capture:
            self._sync_model()
        layout = self._layout(batch)
        if self.capture:
            pieces = None
            if layout is not None:
                pieces = self._pieces.get((bucket, layout.key)) or self._capture(bucket, layout)
                layout = layout if pieces is not None and self._bind(layout, batch) else None
            if layout is None:
                pieces = self._pieces.get(bucket) or self._capture(bucket)
            if pieces is None:  # the capture failed: this step (and every later one) takes the eager path
                return self.model(batch, self.cache)
            self.counts["graph_steps"] += 1
            self.counts["layout_steps"] += layout is not None
            return pieces.replay(batch, n)[:n]
        self.counts["eager_padded_steps"] += 1
        if layout is not None and self._bind(layout, batch):  # the host mirrors a replay: the KDA cores inline
            self.counts["layout_steps"] += 1
            return self._forward(bucket, EagerRun(batch, n, bucket), layout)[:n]
        return self._forward(bucket, EagerRun(batch, n, bucket))[:n]

    def _layout(self, batch: ForwardBatch) -> KDALayout | None:
        if not self.enabled or self.model.backends is None:
            return None
        return self.layouts.lookup(self.model.backends.kda, batch, self._capture_batch)

    def _bind(self, layout: KDALayout, batch: ForwardBatch) -> bool:
        """The step's KDA metadata into the layout's buffers (before its replay, on the same stream)."""
        assert self.model.backends is not None
        try:
            self.model.backends.kda.bind_static(batch, layout.batch, layout.uploads)
        except ValueError as err:  # not expected: one key, one sequence of uploads
            logger.warning("prefill layout graphs off: %s", err)
            self.layouts.enabled = False
            return False
        return True

    def capture_all(self, full_chunk: int | None = None) -> int:
        """Capture every bucket not captured yet, largest first (the pool is sized once, smaller buckets reuse
        it); stops at a failed capture (the pieces are then off). With ``full_chunk`` (the scheduler's token
        budget) equal to the largest bucket, also the two layouts of a long prompt's full chunks — its first,
        and every later one (from a state) — with their KDA cores inside (layouts.py), so a prefill worker's
        first long prompt does not wait for those captures. Returns the buckets captured."""
        if not (self.capture and self.enabled):
            return 0
        self._sync_model()
        done = 0
        for bucket in reversed(self.buckets):
            if bucket in self._pieces:
                continue
            if self._capture(bucket) is None:
                return done
            done += 1
        top = self.buckets[-1]
        kda = self.model.backends.kda if self.model.backends is not None else None
        if full_chunk == top and hasattr(kda, "layout_key"):
            for has_init in (False, True):
                key = ((top,), (has_init,))
                layout = self.layouts.register(key, self._capture_batch)
                if layout is None or (top, key) in self._pieces:
                    continue
                if self._capture(top, layout) is None:
                    break
        return done

    def _capture_batch(self, key: tuple) -> ForwardBatch:
        return capture_batch(key, self.input_ids, self.positions, self.pad.slot)

    def _sync_model(self) -> None:
        backends, hooks = self.model.backends, tuple(self.model.layer_hooks)
        if backends is not self._captured_with[0] or hooks != self._captured_with[1]:
            # a hook added (the P/D producer attaches one after the engine is built) or removed, or other
            # backends: pieces captured before would skip the hook, call a stale one, or run the old kernels
            self._pieces.clear()
            self._captured_with = (backends, hooks)

    def _fill(self, batch: ForwardBatch, n: int, bucket: int) -> None:
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        if n < bucket:
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()

    def _static_batch(self, bucket: int) -> ForwardBatch:
        """The padded rows as one fresh sequence on the scratch targets: what the pieces see (its input ids and
        positions are the static buffers) and what the cores run on during warm-up and capture (no KV row is
        written: every slot is -1; the recurrence starts from zero in the scratch slot)."""
        if bucket not in self._batches:
            dev, pages = self.device, -(-bucket // self.page_size)
            self._batches[bucket] = ForwardBatch(
                input_ids=self.input_ids[:bucket],
                positions=self.positions[:bucket],
                query_start_loc=[0, bucket],
                context_lens=[bucket],
                block_tables=[torch.full((pages,), self.pad.page, dtype=torch.int64, device=dev)],
                slot_mapping=torch.full((bucket,), -1, dtype=torch.int64, device=dev),
                state_slots=[self.pad.slot] if self.cache.recurrent else [-1],
                has_initial_state=[False],
                logits_indices=torch.tensor([bucket - 1], dtype=torch.int64, device=dev),
                request_ids=["prefill-graph-capture"],
                chunk_starts=[0],
                completes_prompt=[False],
                checkpoints=[()],
                kv_write_rows=torch.zeros(0, dtype=torch.int64, device=dev),
            )
        return self._batches[bucket]

    def _forward(self, bucket: int, run: Run, layout: KDALayout | None = None) -> torch.Tensor:
        with self._split(run, layout):
            return self.model(self._static_batch(bucket), self.cache)

    @contextmanager
    def _split(self, run: Run, layout: KDALayout | None = None) -> Iterator[None]:
        """The model's backends and hooks, cut at the cores for one forward."""
        model = self.model
        backends, hooks = model.backends, list(model.layer_hooks)
        assert backends is not None

        def at_boundary(layer: int, _: ForwardBatch) -> None:
            def call_hooks(real: ForwardBatch) -> None:
                for hook in hooks:
                    hook(layer, real)

            run.boundary(call_hooks)

        model.backends = split_backends(backends, run, layout.batch if layout is not None else None)
        model.layer_hooks = [at_boundary] if hooks else []
        try:
            yield
        finally:
            model.backends, model.layer_hooks = backends, hooks

    def _capture(self, bucket: int, layout: KDALayout | None = None) -> Pieces | None:
        """The bucket's pieces, or with ``layout`` its pieces with the KDA cores inside (bound to the scratch
        slot for the warm-up; the capture itself writes nothing)."""
        batch = self._static_batch(bucket)
        if layout is not None and not self._bind(layout, layout.batch):  # before the side stream waits on it
            return None
        current = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(current)
        try:
            with torch.cuda.stream(stream):
                # compiles and autotunes at this bucket's shapes, outside any capture (a layout: one warm-up,
                # for its KDA launches; the bucket's pieces, captured before it, warmed the rest)
                for _ in range(2 if layout is None else 1):
                    self._forward(bucket, EagerRun(batch, bucket, bucket, hooks=False), layout)
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                run = CaptureRun(batch, self._pool)
                run.begin()
                try:
                    hidden = self._forward(bucket, run, layout)
                except Exception:
                    run.abandon()
                    raise
                run.end()
            current.wait_stream(stream)
        except Exception as err:  # an op that syncs or allocates on the host: keep serving eagerly
            torch.cuda.synchronize(self.device)
            if layout is not None:
                logger.warning("prefill layout graph capture failed (%s); KDA cores stay eager", err)
                self.layouts.enabled = False
                return None
            logger.warning("prefill CUDA graph capture failed at %d tokens (%s); prefill runs eagerly", bucket, err)
            self.enabled = False
            return None
        pieces = run.pieces(hidden)
        if layout is None:
            self.counts["captures"] += 1
            self._pieces[bucket] = pieces
        else:
            self.counts["layout_captures"] += 1
            self._pieces[(bucket, layout.key)] = pieces
        return pieces

    def stats(self) -> dict[str, Any]:
        pieces = {b: sum(g is not None for g in p.graphs) for b, p in self._pieces.items() if isinstance(b, int)}
        layouts = {  # "bucket: chunk lengths / from a state" -> graphs (JSON keys)
            f"{k[0]}: {list(k[1][0])} / {list(k[1][1])}": sum(g is not None for g in p.graphs)
            for k, p in self._pieces.items()
            if isinstance(k, tuple)
        }
        return {
            **self.counts,
            "pieces": dict(sorted(pieces.items())),
            "layout_pieces": layouts,
            "layouts_enabled": self.layouts.enabled,
            "capture": self.capture,
            "enabled": self.enabled,
        }
