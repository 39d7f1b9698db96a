"""Pure-decode steps through static padded buffers, captured as one CUDA graph per (batch size, context bucket).

A step is taken here when every chunk is one known token of a running request (no drafts). Its batch is
padded up to the next captured size; its longest context is rounded up to a power-of-two bucket (at least
one page), which fixes the attention kernel's key split in the graph. Graphs are captured lazily, the
first time a (size, bucket) pair is seen: the buffers are first filled with padding only, so the warm-up
and capture runs write nothing but the scratch page and slot, then the step's real rows are filled and
the graph replayed. Inside the graph there is no host sync; the caller syncs only to sample.

On the host (no CUDA), or with capture turned off, the same padded static-buffer step runs eagerly: that
is what the CPU tests compare with the normal path. A capture that fails (an op that syncs, an unsupported
kernel) turns capture off for good with a warning; steps keep running eagerly on the static buffers.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.cache.tensors import CacheTensors
from engine.decode_graph.buffers import StaticDecodeBuffers
from engine.forward_batch import ForwardBatch
from engine.models.base import CausalLM
from engine.pad_targets import PadTargets
from engine.scheduler import ScheduledChunk

logger = logging.getLogger(__name__)


def default_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 16: at most ~12 % padding above 8 rows."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, max(max_batch, 64) + 16, 16)]
    out = sorted({s for s in sizes if s < max_batch} | {max_batch})
    return out


def context_bucket(max_ctx: int, page_size: int, limit: int) -> int:
    bucket = max(page_size, 1 << (max(max_ctx, 1) - 1).bit_length())
    return min(bucket, limit)


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        cache: CacheTensors,
        device: torch.device,
        page_size: int,
        max_model_len: int,
        pad: PadTargets,
        batch_sizes: list[int],
        capture: bool,
    ) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.batch_sizes = sorted(batch_sizes)
        self.page_size = page_size
        self.max_context = -(-max_model_len // page_size) * page_size
        self.buffers = StaticDecodeBuffers(self.batch_sizes[-1], self.max_context // page_size, page_size, pad, device)
        self.capture = capture and device.type == "cuda"
        self.enabled = True
        """Runtime switch (benchmarks compare eager and graph steps on one engine)."""
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, ForwardBatch]] = {}
        self._pool: Any = None
        self.counts = {"graph_steps": 0, "eager_static_steps": 0, "padded_rows": 0, "captures": 0}

    # ---- which steps ---------------------------------------------------------------------------
    def accepts(self, chunks: list[ScheduledChunk]) -> bool:
        if not self.enabled or not chunks or len(chunks) > self.batch_sizes[-1]:
            return False
        if self.model.aux_layer_ids or self.model.layer_hooks:
            return False  # per-layer host work (drafter taps, P/D producer hooks) needs the eager path
        for c in chunks:
            if c.num_tokens != 1 or c.drafts or not c.samples or c.start + 1 > self.max_context:
                return False
        return True

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], carried: list[int] | None = None) -> torch.Tensor:
        """Logits [len(chunks), V] in the model's dtype (``compute_raw_logits``; callers that sample take
        ``.float()``), in chunk order (a view into a static buffer on the graph path: valid until the next
        step); the rows' greedy ids are in ``sampled(len(chunks))`` once the step has run.
        carried: per row, the row of the previous step's greedy ids that is its input id, or -1
        (StaticDecodeBuffers.fill)."""
        n = len(chunks)
        bs = next(s for s in self.batch_sizes if s >= n)
        bucket = context_bucket(max(c.start + 1 for c in chunks), self.page_size, self.max_context)
        self.counts["padded_rows"] += bs - n
        if self.capture:
            entry = self._graphs.get((bs, bucket)) or self._capture(bs, bucket)
            if entry is not None:
                graph, logits, _ = entry
                self.buffers.fill(chunks, bs, bucket, carried)
                graph.replay()
                self.counts["graph_steps"] += 1
                self._copy_checkpoints(chunks)
                return logits[:n]
        host = self.buffers.fill(chunks, bs, bucket, carried)
        batch = self.buffers.batch(self.buffers.meta(bs, bucket), host)
        logits = self._forward(batch)
        self.counts["eager_static_steps"] += 1
        self._copy_checkpoints(chunks)
        return logits[:n]

    def sampled(self, n: int) -> torch.Tensor:
        """[n] int64 greedy ids of the last step's rows, on the device (a static view: the next step rewrites it)."""
        return self.buffers.sampled[:n]

    def _forward(self, batch: ForwardBatch, greedy_out: torch.Tensor | None = None) -> torch.Tensor:
        """One step, as captured: the inputs' device side, the layers, the logits and their greedy ids (into
        ``sampled``, or greedy_out)."""
        bs = batch.decode_meta.batch_size
        self.buffers.prepare(bs)
        hidden = self.model(batch, self.cache)
        logits = self.model.compute_raw_logits(hidden)  # the argmax of bf16 values is the argmax of their fp32
        self.model.backends.greedy.argmax_rows(logits, self.buffers.sampled[:bs] if greedy_out is None else greedy_out)
        return logits

    def _padding_batch(self, bs: int, bucket: int) -> ForwardBatch:
        self.buffers.fill([], bs, bucket)  # padding only: warm-up and capture touch scratch rows alone
        return self.buffers.batch(self.buffers.meta(bs, bucket), None)

    def _warm_up(self, batch: ForwardBatch) -> None:
        """Two padding-only passes before a capture: they build the backends' derived tensors, compile, set up
        cuBLAS workspaces. Their greedy ids go to scratch: a capture can come between two overlapped steps (a new
        batch size or context bucket), and the next step carries the in-flight step's ids from ``sampled``."""
        scratch = torch.empty_like(self.buffers.sampled[: batch.decode_meta.batch_size])
        for _ in range(2):
            self._forward(batch, scratch)

    def _copy_checkpoints(self, chunks: list[ScheduledChunk]) -> None:
        """Prefix-cache rungs at this step's end: the state after the step, copied from the request's slot
        (outside the graph; the conv window after a one-token chunk is the slot's updated window)."""
        for c in chunks:
            for _, dst in c.checkpoints:
                self.cache.copy_slot(c.request.slot_ids[0], dst)

    # ---- capture -------------------------------------------------------------------------------
    def _capture(self, bs: int, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, ForwardBatch] | None:
        batch = self._padding_batch(bs, bucket)
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._warm_up(batch)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = self._forward(batch)  # recorded, not run: ``sampled`` is written at replay
        except Exception as err:  # any sync / unsupported op: keep serving eagerly
            logger.warning(
                "decode CUDA graph capture failed at batch %d, context %d (%s); decode runs eagerly", bs, bucket, err
            )
            self.capture = False
            torch.cuda.synchronize(self.device)
            return None
        self.counts["captures"] += 1
        self._graphs[(bs, bucket)] = (graph, logits, batch)
        return self._graphs[(bs, bucket)]

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "graphs": sorted(self._graphs), "capture": self.capture}
