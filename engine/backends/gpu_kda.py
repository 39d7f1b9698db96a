"""GPU KDA backend: the slot-indexed Triton short conv (fla's causal_conv1d for long prefill chunks), fla-core's
chunk_kda for prefill and its fused recurrent kernel for decode. Same interface and results as torch_ref.py.

Imports triton (and, lazily, fla) — only ``select_backends`` on a CUDA device imports this module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.backends.base import KDABackend
from engine.backends.fallback import fall_back
from engine.backends.gpu_kda_rounds import run_recurrence, write_rung_windows
from engine.backends.gpu_kda_switches import (
    CONV_PLANES,
    DECODE_GATE_IN_KERNEL,
    FLA_CONV_MIN_LEN,
    GATE_IN_CHUNK,
    LOW_RANK_BLOCK_C,
    LOW_RANK_IN_CONV,
    LOW_RANK_MAX_ROWS,
    PLANES_MIN_LEN,
)
from engine.backends.gpu_static import KDADecodeStep
from engine.backends.kda_step import KDAStep, q_lens_of
from engine.backends.per_step import PerStep
from engine.forward_batch import ForwardBatch
from kernels.kda.fla_adapter import chunk_kda_varlen, fla_available
from kernels.short_conv.fla_adapter import conv_step, short_conv_prefill_fla
from kernels.short_conv.in_proj_conv import SYNC_WORDS, in_proj_conv, in_proj_conv_fits, in_proj_conv_from_env
from kernels.short_conv.planes import conv_planes
from kernels.short_conv.triton import LowRankUp, short_conv_update, write_windows
from kernels.triton_utils import LaunchTicket, is_interpreting
from kernels.upload import StaticUploads

logger = logging.getLogger(__name__)


ChunkFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


class GPUKDABackend(KDABackend):
    """Short conv with the slot-indexed Triton kernel (fla's ``causal_conv1d`` for steps with a chunk of at
    least ``FLA_CONV_MIN_LEN`` tokens: 2-3x faster there); the recurrence with fla-core.

    Decode tokens (one per sequence) go through fla's fused recurrent kernel in place on the slot pool;
    prefill chunks through ``chunk_fn`` (fla's ``chunk_kda`` by default) from gathered initial states, with
    the final states scattered back. A request's first chunk starts from a zeroed slot.

    Rung checkpoints (``batch.checkpoints``): the conv window is copied from x / the old window; the
    recurrent state comes from chunk_kda's chunk-boundary states where the rung is a multiple of 64 tokens
    into a segment, else the chunk is cut there (so at most two chunk_kda rounds per layer in practice).
    The boundary states are in q/k's dtype: with a bf16 model the rung states are bf16-rounded (as vLLM's);
    ``exact_checkpoints=True`` cuts at every rung instead (fp32 states, one round per rung).

    ``chunk_fn`` has the signature of ``kernels.kda.fla_adapter.chunk_kda_varlen`` (tests inject a reference).
    """

    def __init__(
        self,
        chunk_fn: ChunkFn | None = None,
        exact_checkpoints: bool = False,
        planes_min_len: int | None = None,
        gate_in_chunk: bool | None = None,
        decode_gate_in_kernel: bool | None = None,
    ) -> None:
        self.chunk_fn = chunk_fn or chunk_kda_varlen
        self.exact_checkpoints = exact_checkpoints
        self.gate_in_chunk = GATE_IN_CHUNK if gate_in_chunk is None else gate_in_chunk
        """Prefill-only steps: the gate applied inside chunk_fn (``GATE_IN_CHUNK``)."""
        self.decode_gate_in_kernel = DECODE_GATE_IN_KERNEL if decode_gate_in_kernel is None else decode_gate_in_kernel
        """All-decode steps: the gate and beta's sigmoid applied inside fla's recurrent kernel."""
        self.low_rank_max_rows = LOW_RANK_MAX_ROWS if LOW_RANK_IN_CONV else 0
        """All-decode steps of at most this many rows (with ``decode_gate_in_kernel``): the up-projections in the
        conv's launch; 0: never."""
        if planes_min_len is None and CONV_PLANES:
            planes_min_len = PLANES_MIN_LEN
        self.planes_min_len = planes_min_len
        """Shortest chunk that takes ``conv_planes`` (None: never; tests set it)."""
        self.in_proj_conv = in_proj_conv_from_env()
        """One-token steps: in_proj's GEMV and the conv in one launch (``project_low_rank_conv_recurrence``)."""
        self._in_proj_sync = LaunchTicket(SYNC_WORDS)
        self._step = PerStep()
        self._fused_gate: Callable | None = None  # fla's, looked up on the first CUDA call (not per layer)
        self._fla_conv_failed = False

    def gate(self, g_raw: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, head_dim: int) -> torch.Tensor:
        """fla's fused gate kernel (one launch instead of six elementwise ones) on CUDA."""
        if g_raw.is_cuda and self._fused_gate is None and fla_available():
            from fla.ops.kda.gate import fused_kda_gate

            self._fused_gate = fused_kda_gate
        if not g_raw.is_cuda or self._fused_gate is None:
            return super().gate(g_raw, a_log, dt_bias, head_dim)
        g = g_raw.unflatten(-1, (-1, head_dim))
        return self._fused_gate(g, a_log.reshape(-1), dt_bias, output_dtype=torch.float32)

    def layout_key(self, batch: ForwardBatch) -> tuple | None:
        """What this step's conv + recurrence launches depend on, besides values in device tensors: the chunk
        lengths and which chunks start from a state. Steps with one key launch the same kernels on the same
        shapes, so one CUDA graph of the core serves them all once ``bind_static`` has refilled its metadata
        (engine/prefill_graph/layouts.py). None where the launches follow host values too: decode rows (their
        own kernel), rung checkpoints (copies at host-chosen slots), padding slots."""
        if batch.decode_meta is not None or not batch.num_seqs or min(batch.state_slots) < 0:
            return None
        q_lens = tuple(q_lens_of(batch))
        if min(q_lens) < 2 or any(batch.checkpoints):
            return None
        return q_lens, tuple(batch.has_initial_state)

    def bind_static(self, values: ForwardBatch, batch: ForwardBatch, uploads: StaticUploads) -> None:
        """``values``' metadata (slots, offsets, chunk tables) written into ``uploads``' fixed buffers and kept
        as ``batch``'s: calls with ``batch`` — or the CUDA graph captured over them — read ``values``' slots.
        Both batches must have one ``layout_key``."""
        key = self.layout_key(values)
        if key is None or (batch is not values and key != self.layout_key(batch)):
            raise ValueError(f"bind_static needs one layout, got {key} / {self.layout_key(batch)}")
        uploads.rewind()
        device = values.input_ids.device
        self._step.put(batch, "kda", KDAStep(values, device, self.exact_checkpoints, uploads))
        self._step.put(
            batch,
            "conv_fla",
            conv_step(values.state_slots, values.query_start_loc, values.has_initial_state, device, uploads),
        )

    def _meta(self, batch: ForwardBatch, device: torch.device) -> KDAStep | KDADecodeStep:
        if batch.decode_meta is not None:
            return self._step.get(batch, "kda", lambda: KDADecodeStep(batch.decode_meta))
        return self._step.get(batch, "kda", lambda: KDAStep(batch, device, self.exact_checkpoints))

    def short_conv(
        self, x: torch.Tensor, conv_cache: torch.Tensor, weight: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        y = self._conv(x, conv_cache, weight, batch, planes=1)
        assert isinstance(y, torch.Tensor)
        return y

    def short_conv_qkv(
        self, x: torch.Tensor, conv_cache: torch.Tensor, weight: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as three contiguous planes: fla's chunk and recurrent KDA kernels take contiguous q / k / v
        only, so column views of one [T, 3P] output cost three full-size copies per KDA layer and step."""
        y = self._conv(x, conv_cache, weight, batch, planes=3)
        q, k, v = y if isinstance(y, tuple) else y.unbind(0)
        return q, k, v

    def _conv(
        self,
        x: torch.Tensor,
        conv_cache: torch.Tensor,
        weight: torch.Tensor,
        batch: ForwardBatch,
        planes: int,
        low_rank: LowRankUp | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        m = self._meta(batch, x.device)
        write_rung_windows(x, conv_cache, weight.shape[1] - 1, m)
        x = x if x.stride(1) == 1 else x.contiguous()  # the q|k|v column view runs as is: no copy
        if low_rank is None and self._fla_conv_fits(x, batch, m):
            try:
                step = self._step.get(
                    batch,
                    "conv_fla",
                    lambda: conv_step(batch.state_slots, batch.query_start_loc, batch.has_initial_state, x.device),
                )
                return short_conv_prefill_fla(x, weight.contiguous(), conv_cache, step, planes=planes)
            except Exception as err:  # e.g. an fla build that refuses this GPU: the slot kernel, for good
                self._fla_conv_failed = True
                fall_back("fla causal_conv1d", "prefill short conv uses the slot kernel", err)
        w = weight.contiguous()
        return short_conv_update(
            x, w, conv_cache, m.slots, m.qsl, m.has_init, max_q_len=m.max_q_len, planes=planes, low_rank=low_rank
        )

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
        """Long prefill steps: q | k | v conv with q and k L2-normed in one launch (kernels/short_conv/planes.py),
        the recurrence told not to norm them again; other steps as the base class."""
        m = self._meta(batch, qkv.device)
        if not self._planes_fit(qkv, batch, m, g.shape[-1]):
            return super().conv_recurrence(qkv, conv_cache, conv_weight, g, beta, state_cache, batch)
        return self._planes_recurrence(qkv, conv_cache, conv_weight, g, beta, state_cache, batch)

    def _planes_recurrence(
        self,
        qkv: torch.Tensor,
        conv_cache: torch.Tensor,
        conv_weight: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state_cache: torch.Tensor,
        batch: ForwardBatch,
        gate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        t, h, hd = g.shape
        m = self._meta(batch, qkv.device)
        write_rung_windows(qkv, conv_cache, conv_weight.shape[1] - 1, m)
        step = self._step.get(
            batch,
            "conv_fla",
            lambda: conv_step(batch.state_slots, batch.query_start_loc, batch.has_initial_state, qkv.device),
        )
        weight = conv_weight.contiguous()
        q, k, v = conv_planes(qkv, weight, conv_cache, step, planes=3, head_dim=hd, norm_planes=2)
        write_windows(qkv, weight, conv_cache, step.slots, step.qsl, step.has_init)  # after the planes read them
        q, k, v = (z.view(t, h, hd) for z in (q, k, v))
        return self.recurrence(q, k, v, g, beta, state_cache, batch, qk_normalized=True, gate=gate)

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
        """All-decode steps (``decode_gate_in_kernel``): the raw gate and beta's logits go to fla's recurrent
        kernel, which applies both as it reads them. Prefill-only steps with ``gate_in_chunk``: the raw gate
        to chunk_fn. Other steps as the base."""
        t, h = beta_logits.shape
        gate = (a_log, dt_bias)
        m = self._meta(batch, qkv.device)
        if self.decode_gate_in_kernel and m.all_decode:
            q, k, v = (z.reshape(t, h, -1) for z in self.short_conv_qkv(qkv, conv_cache, conv_weight, batch))
            g = g_raw.view(t, h, -1)
            return self.recurrence(q, k, v, g, beta_logits, state_cache, batch, gate=gate, beta_logits=True)
        beta = torch.sigmoid(beta_logits)
        if not self.gate_in_chunk or not isinstance(m, KDAStep) or m.dec_slots is not None:  # decode rows
            return self.conv_recurrence(
                qkv,
                conv_cache,
                conv_weight,
                self.gate(g_raw, a_log, dt_bias, g_raw.shape[-1] // h),
                beta,
                state_cache,
                batch,
            )
        g = g_raw.view(t, h, -1)  # raw: chunk_fn applies the gate
        if self._planes_fit(qkv, batch, m, g.shape[-1]):
            return self._planes_recurrence(qkv, conv_cache, conv_weight, g, beta, state_cache, batch, gate)
        q, k, v = (z.reshape(g.shape) for z in self.short_conv_qkv(qkv, conv_cache, conv_weight, batch))
        return self.recurrence(q, k, v, g, beta, state_cache, batch, gate=gate)

    def low_rank_conv_recurrence(
        self,
        qkv: torch.Tensor,
        conv_cache: torch.Tensor,
        conv_weight: torch.Tensor,
        fg_a: torch.Tensor,
        fg_b: torch.Tensor,
        a_log: torch.Tensor,
        dt_bias: torch.Tensor,
        beta_logits: torch.Tensor,
        state_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All-decode steps of at most ``low_rank_max_rows`` rows: the up-projections by
        extra programs of the conv's launch, then fla's recurrent kernel with the raw gate as
        ``gated_conv_recurrence`` gives it; other steps as the base."""
        t = beta_logits.shape[0]
        if self.in_proj_conv:  # its counters made eagerly, before any capture: any step's KDA layers come here
            self._in_proj_sync.get(qkv.device)
        m = self._meta(batch, qkv.device)
        take = self.decode_gate_in_kernel and m.all_decode and 0 < t <= self.low_rank_max_rows
        if not take or fg_a.stride(2) != 1 or fg_b.stride(2) != 1 or fg_a.dtype != fg_b.dtype:
            args = (fg_a, fg_b, a_log, dt_bias, beta_logits, state_cache, batch)
            return super().low_rank_conv_recurrence(qkv, conv_cache, conv_weight, *args)
        up = fg_a.new_empty(2, t, fg_b.shape[1])  # g_raw | the output gate, as the batched GEMM lays them out
        y = self._conv(
            qkv, conv_cache, conv_weight, batch, planes=3, low_rank=LowRankUp(fg_a, fg_b, up, LOW_RANK_BLOCK_C)
        )
        return self._decode_recurrence(y, up, beta_logits, a_log, dt_bias, state_cache, batch)

    def _decode_recurrence(
        self,
        y: torch.Tensor | tuple[torch.Tensor, ...],
        up: torch.Tensor,
        beta_logits: torch.Tensor,
        a_log: torch.Tensor,
        dt_bias: torch.Tensor,
        state_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """After the conv's planes y and the up-projections up [2, T, P] (g_raw | the output gate) of an all-decode
        step: fla's recurrent kernel with the raw gate and beta's logits applied inside it -> (o, out_gate)."""
        t, h = beta_logits.shape
        q, k, v = (z.reshape(t, h, -1) for z in (y if isinstance(y, tuple) else y.unbind(0)))
        gate = (a_log, dt_bias)
        o = self.recurrence(q, k, v, up[0].view(t, h, -1), beta_logits, state_cache, batch, gate=gate, beta_logits=True)
        return o, up[1]

    def project_low_rank_conv_recurrence(
        self,
        x: torch.Tensor,
        in_proj_weight: torch.Tensor,
        conv_channels: int,
        conv_cache: torch.Tensor,
        conv_weight: torch.Tensor,
        fg_b: torch.Tensor,
        a_log: torch.Tensor,
        dt_bias: torch.Tensor,
        state_cache: torch.Tensor,
        batch: ForwardBatch,
        before_recurrence: Callable[[], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One-token all-decode steps with ``TANDEM_KDA_IN_PROJ_CONV=1``: in_proj's GEMV and the conv (with the
        up-projections) in one launch, then the recurrence as ``low_rank_conv_recurrence`` runs it; else None."""
        if not self.in_proj_conv or x.shape[0] != 1 or not self.decode_gate_in_kernel or self.low_rank_max_rows < 1:
            return None
        m = self._meta(batch, x.device)
        if not m.all_decode or getattr(m, "conv_cks", ()) or x.dtype != in_proj_weight.dtype or x.stride(1) != 1:
            return None
        if fg_b.dtype != x.dtype or not in_proj_conv_fits(*in_proj_weight.shape, conv_channels):
            return None
        try:
            sync = self._in_proj_sync.get(x.device)
            packed, y, up = in_proj_conv(
                x, in_proj_weight, conv_channels, conv_weight.contiguous(), conv_cache, m.slots, fg_b, sync,
                query_start_loc=m.qsl, has_initial_state=m.has_init,
            )  # fmt: skip
        except Exception as err:  # the two launches from here on
            self.in_proj_conv = False
            fall_back("KDA in_proj + conv launch", "one-token steps project, then run the conv", err)
            return None
        if before_recurrence is not None:
            before_recurrence()
        beta_logits = packed[:, conv_channels + 2 * fg_b.shape[2] :]
        return self._decode_recurrence(y, up, beta_logits, a_log, dt_bias, state_cache, batch)

    def _planes_fit(self, x: torch.Tensor, batch: ForwardBatch, m: KDAStep | KDADecodeStep, head_dim: int) -> bool:
        """Prefill-only steps with a long chunk (decode rows would be normed again by the recurrent kernel)."""
        return (
            self.planes_min_len is not None
            and (x.is_cuda or is_interpreting())
            and x.stride(1) == 1
            and isinstance(m, KDAStep)
            and m.max_q_len >= self.planes_min_len
            and m.dec_slots is None
            and min(batch.state_slots, default=0) >= 0
            and head_dim & (head_dim - 1) == 0
        )

    def _fla_conv_fits(self, x: torch.Tensor, batch: ForwardBatch, m: KDAStep | KDADecodeStep) -> bool:
        """Long prefill chunks on CUDA (not decode / verify: those stay one graph-safe launch)."""
        return (
            x.is_cuda
            and not self._fla_conv_failed
            and isinstance(m, KDAStep)
            and m.max_q_len >= FLA_CONV_MIN_LEN
            and min(batch.state_slots, default=0) >= 0
            and fla_available()
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
        qk_normalized: bool = False,
        gate: tuple[torch.Tensor, torch.Tensor] | None = None,
        beta_logits: bool = False,
    ) -> torch.Tensor:
        """``qk_normalized``: q and k come L2-normed (``conv_planes``), prefill-only steps. ``gate`` (A_log,
        dt_bias): g is the raw gate projection, applied inside chunk_fn (prefill-only steps) or fla's recurrent
        kernel (all-decode steps). ``beta_logits``: beta holds the logits, their sigmoid taken in the recurrent
        kernel (all-decode steps)."""
        m = self._meta(batch, q.device)
        return run_recurrence(self.chunk_fn, m, q, k, v, g, beta, state_cache, qk_normalized, gate, beta_logits)


def gpu_kda_backend() -> KDABackend:
    """fla-core's KDA when importable, else the reference recurrence (correct, slow) with a warning."""
    from kernels.kda.fla_adapter import fla_available

    if fla_available():
        return GPUKDABackend()
    from engine.backends.torch_ref import TorchKDABackend

    logger.warning(
        "fla-core is not importable: KDA runs the PyTorch reference on the GPU (pip install fla-core==0.6.0)"
    )
    return TorchKDABackend()


__all__ = ["GPUKDABackend", "gpu_kda_backend"]
