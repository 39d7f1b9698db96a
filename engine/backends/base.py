"""Backend interfaces. Every method works on the flat varlen batch of a ForwardBatch."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.backends.norm import TorchNormBackend
from engine.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AddNorm:
    """The norm after a block, handed to the block's backend to run in its last launch: the caller wants
    ``(rms_norm(residual + y) * weight, residual + y)`` for the block's output y instead of y
    (``MoEBackend.experts_add_norm``)."""

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class QKNormRope:
    """What GQA's attention input takes before the cache write (Qwen3): per-head q / k RMSNorm weights and their eps,
    the rotary (``rotary(q, k, positions)``) and its inverse frequencies (its angles are ``positions * inv_freq``)."""

    q_norm_weight: torch.Tensor
    k_norm_weight: torch.Tensor
    eps: float
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    inv_freq: torch.Tensor


@dataclass(frozen=True)
class MLADims:
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


class AttentionBackend(ABC):
    @abstractmethod
    def write_kv(self, cache: torch.Tensor, batch: ForwardBatch, entries: torch.Tensor) -> None:
        """Store this step's per-token entries [T, *entry] into their pages; rows whose
        batch.slot_mapping is -1 are skipped (their KV is reused from the prefix cache)."""

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
        """Store MLA's latent ``RMSNorm(c_kv) | k_pe`` from kv_a_proj's output [T, kv_lora_rank + rope] (``norms``:
        the model's norm backend). Here the model's ops through ``write_kv``; a backend may write it in one
        launch (the GPU backend: kernels/paged_attention/latent_write.py)."""
        c_kv, k_pe = kv_a.split([kv_lora_rank, kv_a.shape[-1] - kv_lora_rank], dim=-1)
        self.write_kv(cache, batch, torch.cat([norms.rms_norm(c_kv, norm_weight, eps), k_pe], dim=-1))

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
        """Qwen3's attention input: q [T, H, D] and k [T, KVH, D] each normed per head (``norms``, the model's norm
        backend) and rotated (``qk``); k and v [T, KVH, D] stored by ``write_kv``; returns q. Here the model's ops; a
        backend may run them in one launch (the GPU backend: kernels/paged_attention/qk_norm_rope.py)."""
        q, k = norms.rms_norm(q, qk.q_norm_weight, qk.eps), norms.rms_norm(k, qk.k_norm_weight, qk.eps)
        q, k = qk.rotary(q, k, batch.positions)
        self.write_kv(cache, batch, torch.stack([k, v], dim=1))
        return q

    @abstractmethod
    def gqa(self, q: torch.Tensor, cache: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
        """q [T, Hq, D] over a K|V page cache -> [T, Hq, D]; causal over each sequence's cache."""

    @abstractmethod
    def mla(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        batch: ForwardBatch,
        kv_b_weight: torch.Tensor,
        dims: MLADims,
        scale: float,
    ) -> torch.Tensor:
        """q [T, H, nope+rope] over a latent page cache -> [T, H, v_head_dim]."""


class KDABackend(ABC):
    def run_mixer(
        self, mixer: Callable[[torch.Tensor, ForwardBatch], torch.Tensor], x: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """Run a KDA layer's token mixer (projections .. output projection) over x [T, hidden]. A backend may
        run it over another row layout and return x's (PCP: contiguous segments, engine/parallel/pcp_kda.py)."""
        return mixer(x, batch)

    def gate(self, g_raw: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, head_dim: int) -> torch.Tensor:
        """Log-space channel decay [T, H, K] fp32 from the gate projection g_raw [T, H*K]
        (contract: kernels/kda/naive.kda_gate)."""
        from kernels.kda.naive import kda_gate

        return kda_gate(g_raw, a_log, dt_bias, head_dim)

    @abstractmethod
    def short_conv(
        self, x: torch.Tensor, conv_cache: torch.Tensor, weight: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """Depthwise causal conv + SiLU of x [T, C] with weight [C, W]; reads and updates each
        sequence's window in conv_cache[slot] ([slots, C, W-1]). For each (pos, dst) in
        batch.checkpoints[i], also writes the window after `pos` tokens to conv_cache[dst]."""

    def short_conv_qkv(
        self, x: torch.Tensor, conv_cache: torch.Tensor, weight: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``short_conv`` of the q | k | v projections (x [T, 3P]) returned as q, k, v [T, P] each. Here views of
        one output; a backend whose KDA kernels need contiguous q / k / v writes three planes instead."""
        q, k, v = self.short_conv(x, conv_cache, weight, batch).chunk(3, dim=-1)
        return q, k, v

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
        """``short_conv_qkv`` of the q | k | v projections, then ``recurrence`` with g [T, H, K] and beta [T, H]:
        one call, so a piecewise step (engine/prefill_graph) hands q, k, v from the conv to the recurrence
        without copying them into graph buffers."""
        t, h, hd = g.shape
        q, k, v = (z.reshape(t, h, hd) for z in self.short_conv_qkv(qkv, conv_cache, conv_weight, batch))
        return self.recurrence(q, k, v, g, beta, state_cache, batch)

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
        """``gate`` of the raw gate projection g_raw [T, H*K] and beta = sigmoid(beta_logits) [T, H] (HF's
        ``b_proj(x).sigmoid()``, in the logits' dtype), then ``conv_recurrence``: the KDA layer's call, so a
        backend may apply the gate and the sigmoid inside its kernels instead (the GPU backend: prefill chunks
        with ``gate_in_chunk``, decode steps in fla's recurrent kernel)."""
        beta = torch.sigmoid(beta_logits)
        g = self.gate(g_raw, a_log, dt_bias, g_raw.shape[-1] // beta.shape[-1])
        return self.conv_recurrence(qkv, conv_cache, conv_weight, g, beta, state_cache, batch)

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
        """The gate's and the output gate's up-projections of their low-rank halves fg_a [T, 2, K] (f_a | g_a)
        through fg_b [2, P, K] (f_b | g_b) -> (g_raw, out_gate) [T, P] each, then ``gated_conv_recurrence`` with
        g_raw: the packed KDA layer's call -> (o, out_gate), so a backend may run the up-projections inside its
        conv launch (the GPU backend at decode steps: kernels/short_conv/low_rank.py)."""
        g_raw, out_gate = torch.bmm(fg_a.transpose(0, 1), fg_b.transpose(1, 2))  # [2, T, K] @ [2, K, P]
        args = (g_raw, a_log, dt_bias, beta_logits, state_cache, batch)
        return self.gated_conv_recurrence(qkv, conv_cache, conv_weight, *args), out_gate

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
        """``low_rank_conv_recurrence`` of x [T, hidden] through in_proj_weight (q | k | v in its first
        conv_channels rows, then f_a | g_a, then beta's logits) where the backend runs the projection inside the
        conv's launch (the GPU backend at one-token steps: kernels/short_conv/in_proj_conv.py) -> (o, out_gate),
        calling ``before_recurrence`` between the two; None: it does not, and the caller projects first. Only
        for a projection the dense backend would run as the one-row GEMV (``Backends.dense.runs_gemv``)."""
        return None

    @abstractmethod
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
        """KDA over q, k, g [T, H, K], v [T, H, V], beta [T, H] (q/k un-normalised; g log-decay);
        reads and updates state_cache[slot] ([slots, H, K, V] fp32). Returns o [T, H, V] in fp32 or
        in v's dtype (the caller casts it to the model's dtype).
        For each (pos, dst) in batch.checkpoints[i], also writes the state after `pos` tokens to
        state_cache[dst] (rung checkpoints for the prefix cache)."""


class MoEBackend(ABC):
    def router_logits(
        self, x: torch.Tensor, weight: torch.Tensor, weight_fp32: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The router's fp32 logits x @ weight^T [T, E] (``engine.models.layers.router_logits``), in a form this
        backend's ``route`` takes: the GPU backend may give split-K partial sums [S, T, E] at decode sizes."""
        from engine.models.layers import router_logits  # the models import this module

        return router_logits(x, weight, weight_fp32)

    def route_hidden(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_fp32: torch.Tensor | None,
        correction_bias: torch.Tensor | None,
        top_k: int,
        renormalize: bool,
        scaling_factor: float,
        extra_expert: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The router over x [T, H] and its routing: ``route(router_logits(x, weight, weight_fp32), ...)``; a
        backend may do both in one launch."""
        logits = self.router_logits(x, weight, weight_fp32)
        return self.route(logits, correction_bias, top_k, renormalize, scaling_factor, extra_expert=extra_expert)

    @abstractmethod
    def route(
        self,
        router_logits: torch.Tensor,
        correction_bias: torch.Tensor | None,
        top_k: int,
        renormalize: bool,
        scaling_factor: float,
        extra_expert: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sigmoid top-k routing -> (weights [T, k] fp32, expert ids [T, k]). extra_expert: one more column,
        (extra_expert, 1.0) for every token, i.e. [T, k + 1] (the shared expert taken as a routed one)."""

    def folds_shared(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` rows should run the shared expert as one more routed expert (index E of
        weight tensors holding E + 1 experts, routing weight 1.0: ``route(extra_expert=E)``) instead of as a
        separate MLP added after. The sum is the same function; a backend whose expert kernels take it in the
        same launches says yes (the GPU backend at decode sizes: three launches a MoE layer fewer)."""
        return False

    def fuses_add_norm(self, num_tokens: int) -> bool:
        """Whether ``experts_add_norm`` runs for a step of ``num_tokens`` rows (the layer asks first)."""
        return False

    def experts_add_norm(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        w1: torch.Tensor,
        w3: torch.Tensor,
        w2: torch.Tensor,
        w13: torch.Tensor,
        add_norm: AddNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``experts`` followed by the next norm (``AddNorm``), where ``fuses_add_norm`` said yes."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse the next norm (fuses_add_norm is False)")

    def route_experts_add_norm(
        self,
        x: torch.Tensor,
        router_weight: torch.Tensor,
        router_weight_fp32: torch.Tensor | None,
        correction_bias: torch.Tensor | None,
        top_k: int,
        renormalize: bool,
        scaling_factor: float,
        extra_expert: int,
        experts: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        add_norm: AddNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A MoE block with its shared expert folded (expert ``extra_expert``), where ``fuses_add_norm`` said yes:
        ``route_hidden`` then ``experts_add_norm`` on ``experts`` = (w1, w3, w2, w13). A backend may run the
        two in fewer launches (the GPU backend at one token: kernels/moe/route_gate_up.py)."""
        weights, ids = self.route_hidden(
            x, router_weight, router_weight_fp32, correction_bias, top_k, renormalize, scaling_factor,
            extra_expert=extra_expert,
        )  # fmt: skip
        return self.experts_add_norm(x, weights, ids, *experts, add_norm)

    @abstractmethod
    def experts(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        w1: torch.Tensor,
        w3: torch.Tensor,
        w2: torch.Tensor,
        w13: torch.Tensor | None = None,
        add: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Weighted sum of SwiGLU experts; w1/w3 [E, I, H], w2 [E, H, I]. w13 [E, 2I, H], when given, is
        w1 | w3 in one tensor (w1 and w3 are views of it: CausalLM.pack_weights), for one GEMM instead of two.
        ``add`` [T, H] (the shared expert's output) is added to the result in x's dtype: ``y + add``, the
        same rounding as a separate add (the GPU backend does it inside its combine)."""
