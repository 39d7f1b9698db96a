"""Cutting a step's forward into graph pieces and eager cores, and replaying them.

The model's Python forward runs unchanged over the padded static rows; backends wrapped by ``split_backends``
hand each core call to the current run instead of running it:

- ``EagerRun`` (the host, and the warm-up before a capture): the core runs on the first ``n`` rows with the
  step's real batch, and its outputs are padded back to the bucket with zero rows;
- ``CaptureRun``: the pieces between the cores are captured as CUDA graphs in one pool; each core runs once,
  eagerly, on the capture batch (scratch targets only) so its outputs' shapes are known, and is recorded as a
  ``CoreStep``. The next piece reads the core's outputs from buffers it allocates itself;
- ``Pieces.replay``: piece 0, core 0 on the real rows (outputs copied into the next piece's buffers, padding
  rows zeroed), piece 1, ... With no Python forward at all: the host's work is the cores and one replay each.

A core is a backend call whose launches follow the step's sequence layout (lengths, pages, slots, prefix):
attention and its KV write, the KDA short conv and recurrence. The per-layer hooks (the P/D producer) run
between pieces too, with the real batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.backends import Backends
from engine.backends.base import AttentionBackend, KDABackend, MLADims, QKNormRope
from engine.backends.norm import TorchNormBackend
from engine.forward_batch import ForwardBatch
from engine.prefill_graph.weak import weak_view

CoreFn = Callable[..., Any]
"""(batch, *row tensors) -> a tensor, a tuple of tensors or None."""


def _flat(out: Any) -> tuple[torch.Tensor, ...]:
    if out is None:
        return ()
    return tuple(out) if isinstance(out, tuple) else (out,)


def _like(out: Any, flat: tuple[torch.Tensor, ...]) -> Any:
    if out is None:
        return None
    return flat if isinstance(out, tuple) else flat[0]


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    full = t.new_zeros((rows, *t.shape[1:]))
    full[: t.shape[0]] = t
    return full


class EagerRun:
    """Cores on the first ``n`` rows with ``batch``; outputs padded back to ``rows`` with zero rows."""

    def __init__(self, batch: ForwardBatch, n: int, rows: int, hooks: bool = True) -> None:
        self.batch, self.n, self.rows = batch, n, rows
        self.hooks = hooks  # False: a warm-up on the capture batch, which no hook may see

    def core(self, fn: CoreFn, rows: tuple[torch.Tensor, ...]) -> Any:
        out = fn(self.batch, *(r[: self.n] for r in rows))
        return _like(out, tuple(_pad_rows(t, self.rows) for t in _flat(out)))

    def boundary(self, fn: Callable[[ForwardBatch], None]) -> None:
        if self.hooks:
            fn(self.batch)


@dataclass(frozen=True)
class CoreStep:
    """One core between two pieces: its inputs and the next piece's buffers, both held weakly."""

    fn: CoreFn
    rows: tuple[torch.Tensor, ...]
    outs: tuple[torch.Tensor, ...]

    def run(self, batch: ForwardBatch, n: int) -> None:
        out = self.fn(batch, *(r[:n] for r in self.rows))
        for static, got in zip(self.outs, _flat(out), strict=True):
            static[:n].copy_(got)
            if n < static.shape[0]:
                static[n:].zero_()  # padding rows stay finite whatever the pool held there


@dataclass(frozen=True)
class Pieces:
    """One bucket's graphs (None: a piece with no kernels) and the cores between them."""

    graphs: tuple[torch.cuda.CUDAGraph | None, ...]
    steps: tuple[CoreStep, ...]
    hidden: torch.Tensor
    """The final-normed hidden states [bucket, hidden] the last piece writes (held weakly)."""

    def replay(self, batch: ForwardBatch, n: int) -> torch.Tensor:
        for i, graph in enumerate(self.graphs):
            if graph is not None:
                graph.replay()
            if i < len(self.steps):
                self.steps[i].run(batch, n)
        return self.hidden


class CaptureRun:
    """Captures the pieces of one forward into ``pool``; cores run eagerly on ``batch`` (scratch targets)."""

    def __init__(self, batch: ForwardBatch, pool: Any) -> None:
        self.batch, self.pool = batch, pool
        self.graphs: list[torch.cuda.CUDAGraph | None] = []
        self.steps: list[CoreStep] = []
        self._graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def end(self) -> None:
        assert self._graph is not None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self._graph.capture_end()
        empty = any("empty" in str(w.message) for w in caught)  # torch warns; replaying it would raise
        self.graphs.append(None if empty else self._graph)
        self._graph = None

    def abandon(self) -> None:
        """End a capture that failed part-way (its graph is dropped)."""
        if self._graph is not None:
            graph, self._graph = self._graph, None
            with contextlib.suppress(RuntimeError):  # an invalidated capture reports its failure again
                graph.capture_end()

    def core(self, fn: CoreFn, rows: tuple[torch.Tensor, ...]) -> Any:
        self.end()
        out = fn(self.batch, *rows)
        self.begin()
        statics = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in _flat(out))
        self.steps.append(CoreStep(fn, tuple(map(weak_view, rows)), tuple(map(weak_view, statics))))
        return _like(out, statics)

    def boundary(self, fn: Callable[[ForwardBatch], None]) -> None:
        self.end()
        self.steps.append(CoreStep(fn, (), ()))  # hooks: not run on the capture batch, only at replays
        self.begin()

    def pieces(self, hidden: torch.Tensor) -> Pieces:
        return Pieces(tuple(self.graphs), tuple(self.steps), weak_view(hidden))


Run = EagerRun | CaptureRun


class SplitAttention(AttentionBackend):
    """``inner``'s attention with its layout-dependent calls handed to ``run`` as cores."""

    def __init__(self, inner: AttentionBackend, run: Run) -> None:
        self.inner, self.run = inner, run

    def write_kv(self, cache: torch.Tensor, batch: ForwardBatch, entries: torch.Tensor) -> None:
        inner = self.inner
        return self.run.core(lambda b, e: inner.write_kv(cache, b, e), (entries,))

    def write_mla_latent(
        self,
        cache: torch.Tensor,
        batch: ForwardBatch,
        kv_a: torch.Tensor,
        kv_lora_rank: int,
        norm_weight: torch.Tensor,
        eps: float,
        norms: TorchNormBackend,
    ) -> None:
        """The inner backend's write as the core (the GPU's one launch), so graphs and eager steps write alike."""
        inner = self.inner
        return self.run.core(
            lambda b, kv: inner.write_mla_latent(cache, b, kv, kv_lora_rank, norm_weight, eps, norms), (kv_a,)
        )

    def gqa_qk_norm_rope_write(
        self,
        cache: torch.Tensor,
        batch: ForwardBatch,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        qk: QKNormRope,
        norms: TorchNormBackend,
    ) -> torch.Tensor:
        """The inner backend's norms, RoPE and write as the core (the GPU's one launch), as ``write_mla_latent``."""
        inner = self.inner
        return self.run.core(lambda b, q, k, v: inner.gqa_qk_norm_rope_write(cache, b, q, k, v, qk, norms), (q, k, v))

    def gqa(self, q: torch.Tensor, cache: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
        inner = self.inner
        return self.run.core(lambda b, q: inner.gqa(q, cache, b, scale), (q,))

    def mla(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        batch: ForwardBatch,
        kv_b_weight: torch.Tensor,
        dims: MLADims,
        scale: float,
    ) -> torch.Tensor:
        inner = self.inner
        return self.run.core(lambda b, q: inner.mla(q, cache, b, kv_b_weight, dims, scale), (q,))


class SplitKDA(KDABackend):
    """``inner``'s KDA with the short conv and the recurrence handed to ``run`` as cores (the model calls them as
    one, ``conv_recurrence``: q, k, v never leave the core); the gate (row-wise) stays in the pieces.

    With ``inline`` (a layout's capture batch, engine/prefill_graph/layouts.py) they are not cores: they run in
    place on its rows, inside the piece being captured (or, on the host, eagerly), reading the metadata that
    ``bind_static`` put under that batch; their outputs are padded back to the bucket's rows."""

    def __init__(self, inner: KDABackend, run: Run, inline: ForwardBatch | None = None) -> None:
        self.inner, self.run, self.inline = inner, run, inline

    def _core(self, fn: CoreFn, rows: tuple[torch.Tensor, ...]) -> Any:
        if self.inline is None:
            return self.run.core(fn, rows)
        n = self.inline.num_tokens
        out = fn(self.inline, *(r[:n] for r in rows))
        return _like(out, tuple(_pad_rows(t, rows[0].shape[0]) for t in _flat(out)))

    def run_mixer(self, mixer: Any, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.inner.run_mixer(mixer, x, batch)

    def gate(self, g_raw: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, head_dim: int) -> torch.Tensor:
        return self.inner.gate(g_raw, a_log, dt_bias, head_dim)

    def short_conv(
        self, x: torch.Tensor, conv_cache: torch.Tensor, weight: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        inner = self.inner
        return self._core(lambda b, x: inner.short_conv(x, conv_cache, weight, b), (x,))

    def short_conv_qkv(
        self, x: torch.Tensor, conv_cache: torch.Tensor, weight: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inner = self.inner
        return self._core(lambda b, x: tuple(inner.short_conv_qkv(x, conv_cache, weight, b)), (x,))

    def conv_recurrence(
        self,
        qkv: torch.Tensor,
        conv_cache: torch.Tensor,
        conv_weight: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        inner = self.inner
        return self._core(
            lambda b, qkv, g, beta: inner.conv_recurrence(qkv, conv_cache, conv_weight, g, beta, state_cache, b),
            (qkv, g, beta),
        )

    def gated_conv_recurrence(
        self,
        qkv: torch.Tensor,
        conv_cache: torch.Tensor,
        conv_weight: torch.Tensor,
        g_raw: torch.Tensor,
        a_log: torch.Tensor,
        dt_bias: torch.Tensor,
        beta_logits: torch.Tensor,
        state_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        inner = self.inner
        if not getattr(inner, "gate_in_chunk", False):  # the gate (row-wise) in the piece, the core as before
            return super().gated_conv_recurrence(
                qkv, conv_cache, conv_weight, g_raw, a_log, dt_bias, beta_logits, state_cache, batch
            )
        return self._core(
            lambda b, qkv, g_raw, logits: inner.gated_conv_recurrence(
                qkv, conv_cache, conv_weight, g_raw, a_log, dt_bias, logits, state_cache, b
            ),
            (qkv, g_raw, beta_logits),
        )

    def recurrence(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        inner = self.inner
        return self._core(
            lambda b, q, k, v, g, beta: inner.recurrence(q, k, v, g, beta, state_cache, b), (q, k, v, g, beta)
        )


def split_backends(be: Backends, run: Run, kda_inline: ForwardBatch | None = None) -> Backends:
    return dataclasses.replace(be, attention=SplitAttention(be.attention, run), kda=SplitKDA(be.kda, run, kda_inline))
