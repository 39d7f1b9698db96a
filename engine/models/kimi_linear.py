"""Kimi-Linear: KDA linear-attention layers and MLA (NoPE) full-attention layers, dense + MoE MLPs.

Facts: ../shared/reference/kimi-linear.md. Parameter names are the Moonshot checkpoint's
(``self_attn.q_conv1d``, ``block_sparse_moe.experts.{j}.w1`` ...); experts are stacked here as
``experts.w1 [E, I, H]`` and the loader fills one expert slice per checkpoint tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.backends import Backends
from engine.backends.base import AddNorm, MLADims
from engine.cache.tensors import CacheTensors
from engine.forward_batch import ForwardBatch
from engine.model_config import ModelConfig
from engine.models.base import CausalLM
from engine.models.layers import (
    GatedMLP,
    GatedRMSNorm,
    PackedProjection,
    PreNormDecoderLayer,
    RMSNorm,
    norm_after_output,
    project,
    project_norm_after,
)


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        h, hd, p = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_proj_dim
        self.num_heads, self.head_dim = h, hd
        w = cfg.conv_kernel_size
        self.q_proj = nn.Linear(cfg.hidden_size, p, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, p, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, p, bias=False)
        self.q_conv1d = nn.Module()
        self.k_conv1d = nn.Module()
        self.v_conv1d = nn.Module()
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            conv.weight = nn.Parameter(torch.zeros(p, 1, w))
        self.f_a_proj = nn.Linear(cfg.hidden_size, hd, bias=False)
        self.f_b_proj = nn.Linear(hd, p, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(p))
        self.A_log = nn.Parameter(torch.zeros(1, 1, h, 1))
        self.b_proj = nn.Linear(cfg.hidden_size, h, bias=False)
        self.g_a_proj = nn.Linear(cfg.hidden_size, hd, bias=False)
        self.g_b_proj = nn.Linear(hd, p, bias=False)
        self.o_norm = GatedRMSNorm(hd, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(p, cfg.hidden_size, bias=False)
        self.in_proj: PackedProjection | None = None
        """q | k | v | f_a | g_a | b as one GEMM (pack_weights), else six."""
        self.fg_b: torch.Tensor | None = None
        """f_b | g_b weights as one [2, P, K] tensor (pack_weights): both low-rank up-projections in one batched
        GEMM over the adjacent f_a | g_a columns of in_proj's output, one launch a layer less."""
        self._conv_packed: torch.Tensor | None = None

    def pack_weights(self) -> None:
        lins = [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.g_a_proj, self.b_proj]
        self.in_proj = PackedProjection(lins)
        self.fg_b = torch.stack([self.f_b_proj.weight.data, self.g_b_proj.weight.data])
        self.f_b_proj.weight = nn.Parameter(self.fg_b[0], requires_grad=False)
        self.g_b_proj.weight = nn.Parameter(self.fg_b[1], requires_grad=False)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        packed = self.conv_weight()  # built once here instead of a cat per step
        for conv, view in zip(convs, packed.split([c.weight.shape[0] for c in convs]), strict=True):
            conv.weight = nn.Parameter(view.unsqueeze(1), requires_grad=False)
        self._conv_packed = packed

    def conv_weight(self) -> torch.Tensor:
        """q|k|v conv kernels as one depthwise [3P, W] weight, matching the conv window layout."""
        if self._conv_packed is not None:
            return self._conv_packed
        return torch.cat([c.weight[:, 0] for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)], dim=0)

    def input_weight(self, rows: int) -> torch.Tensor | None:
        """in_proj's packed weight, which ``forward(projected=True)`` takes the input through (PreNormDecoderLayer)."""
        return self.in_proj.weight if self.in_proj is not None and self.fg_b is not None else None

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: CacheTensors,
        be: Backends,
        projected: bool = False,
        norm_after: AddNorm | None = None,
    ):
        """x [T, hidden], or with ``projected`` x already through in_proj ([T, 3P + 2K + H]: ``input_weight``) ->
        the output [T, hidden], or with ``norm_after`` the pair of the norm after it (``project_norm_after``)."""

        def mix(xs: torch.Tensor, bs: ForwardBatch):
            # the norm after the projection only in x's own row layout (PCP's run_mixer may hand over another)
            return self._mix(xs, bs, cache, be, projected, norm_after if xs is x else None)

        out = be.kda.run_mixer(mix, x, batch)
        if norm_after is None or isinstance(out, tuple):
            return out
        return norm_after_output(out, norm_after, be)

    def _mix(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: CacheTensors,
        be: Backends,
        projected: bool = False,
        norm_after: AddNorm | None = None,
    ):
        t, h, hd = x.shape[0], self.num_heads, self.head_dim
        conv, state = cache.conv[self.layer_idx], cache.recurrent[self.layer_idx]
        # g_raw [T, H*K]: the gate (log-space decay), and b: beta's logits [T, H], are applied by the backend
        # (inside its decode kernel on the GPU)
        if self.in_proj is not None and self.fg_b is not None:
            p3 = sum(self.in_proj.sizes[:3])
            # one-token GPU steps may run in_proj's GEMV inside the conv's launch (TANDEM_KDA_IN_PROJ_CONV)
            both = None
            if not projected and be.dense.runs_gemv(x, self.in_proj.weight):
                both = be.kda.project_low_rank_conv_recurrence(
                    x, self.in_proj.weight, p3, conv, self.conv_weight(), self.fg_b, self.A_log, self.dt_bias, state,
                    batch, before_recurrence=lambda: be.l2.weights(t, self.o_proj.weight),
                )  # fmt: skip
            if both is not None:
                o, out_gate = both
            else:
                packed = x if projected else self.in_proj(x, be)
                be.l2.weights(t, self.o_proj.weight)  # read after the conv and the recurrence, which leave HBM idle
                qkv, fg_a, b = packed.split([p3, 2 * hd, h], dim=-1)  # column views of one [T, 3P+2K+H]
                # f_a | g_a [T, 2, K] (a strided view, read in place) through f_b | g_b [2, P, K]: g_raw | out gate
                o, out_gate = be.kda.low_rank_conv_recurrence(
                    qkv, conv, self.conv_weight(), fg_a.view(t, 2, hd), self.fg_b, self.A_log, self.dt_bias, b,
                    state, batch,
                )  # fmt: skip
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [T, 3P]
            f_a, g_a, b = self.f_a_proj(x), self.g_a_proj(x), self.b_proj(x)
            g_raw, out_gate = self.f_b_proj(f_a), self.g_b_proj(g_a)
            o = be.kda.gated_conv_recurrence(
                qkv, conv, self.conv_weight(), g_raw, self.A_log, self.dt_bias, b, state, batch
            )
        o, norm = o.to(x.dtype), self.o_norm
        be.l2.join()
        o_flat, w = o.reshape(t, h * hd), self.o_proj.weight
        fused = be.dense.gated_norm_linear(o_flat, out_gate, norm.weight, norm.eps, w, norm_after=norm_after)
        if fused is not None:  # one-row GPU steps: the norm inside the projection's launch (and the one after it)
            return fused
        normed = norm(o, out_gate.view(t, h, hd), be).reshape(t, h * hd)
        return project(normed, w, be) if norm_after is None else project_norm_after(normed, w, norm_after, be)


PACKED_QKV_A_MAX_ROWS = 256
"""Steps up to this many rows take MLA's q | kv_a as one GEMM: a decode step is launch-bound, and the absorbed
decode reads the strided q in place. Longer steps keep two GEMMs, so the prefill kernels get a contiguous q."""


class KimiMLAAttention(nn.Module):
    """MLA without q LoRA and without rotary (NoPE); caches the normed latent and k_pe."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.dims = MLADims(cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
        qk_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.scale = qk_head**-0.5  # the unrotated rope dims still count in the scale
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * qk_head, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            cfg.kv_lora_rank, self.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * cfg.v_head_dim, cfg.hidden_size, bias=False)
        self.q_kv_a: PackedProjection | None = None
        """q | kv_a as one GEMM (pack_weights), taken by steps of at most ``PACKED_QKV_A_MAX_ROWS`` rows."""

    def pack_weights(self) -> None:
        """q_proj | kv_a_proj_with_mqa packed (one GEMM for decode-sized steps), and the cuDNN prefill path's
        stacked kv_b weight (keys whole out of one GEMM: kernels/paged_attention/sdpa_prefill.py), built here
        where it will be used, so the cache is sized after it exists."""
        from kernels.paged_attention.sdpa_prefill import cudnn_self_attention_usable, keys_values_weight

        self.q_kv_a = PackedProjection([self.q_proj, self.kv_a_proj_with_mqa])
        w, d = self.kv_b_proj.weight, self.dims
        if cudnn_self_attention_usable(w.dtype, w.device, d.qk_nope_head_dim + d.qk_rope_head_dim, d.v_head_dim):
            keys_values_weight(w, self.num_heads, d.qk_rope_head_dim, d.qk_nope_head_dim, d.v_head_dim, w.dtype)

    def input_weight(self, rows: int) -> torch.Tensor | None:
        """q | kv_a's packed weight at steps that take it, which ``forward(projected=True)`` takes the input through
        (PreNormDecoderLayer)."""
        return self.q_kv_a.weight if self.q_kv_a is not None and rows <= PACKED_QKV_A_MAX_ROWS else None

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: CacheTensors,
        be: Backends,
        projected: bool = False,
        norm_after: AddNorm | None = None,
    ):
        """x [T, hidden], or with ``projected`` x already through q | kv_a (``input_weight``) -> the output
        [T, hidden], or with ``norm_after`` the pair of the norm after it (``project_norm_after``)."""
        t = x.shape[0]
        if projected:
            q, kv_a = x.split(self.q_kv_a.sizes, dim=-1)
        elif self.q_kv_a is not None and t <= PACKED_QKV_A_MAX_ROWS:
            q, kv_a = self.q_kv_a(x, be).split(self.q_kv_a.sizes, dim=-1)  # column views of one GEMM's output
        else:
            q, kv_a = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        be.l2.weights(t, self.o_proj.weight)  # read after the attention's split and combine
        kv_pages = cache.kv[self.layer_idx]
        norm = self.kv_a_layernorm
        be.attention.write_mla_latent(kv_pages, batch, kv_a, self.dims.kv_lora_rank, norm.weight, norm.eps, be.norm)
        o = be.attention.mla(
            q.view(t, self.num_heads, -1), kv_pages, batch, self.kv_b_proj.weight, self.dims, self.scale
        )
        be.l2.join()
        if norm_after is not None:
            return project_norm_after(o.reshape(t, -1), self.o_proj.weight, norm_after, be)
        return project(o.reshape(t, -1), self.o_proj.weight, be)


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.cfg = cfg
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(e, h))
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(e))
        self.experts = nn.Module()
        self.experts.w1 = nn.Parameter(torch.zeros(e, i, h))  # gate
        self.experts.w3 = nn.Parameter(torch.zeros(e, i, h))  # up
        self.experts.w2 = nn.Parameter(torch.zeros(e, h, i))  # down
        self.shared_experts = GatedMLP(h, i * cfg.num_shared_experts) if cfg.num_shared_experts else None
        self.w13: torch.Tensor | None = None
        """experts.w1 | w3 as one [E, 2I, H] tensor (pack_weights): the gate and up GEMMs as one."""
        self._gate_fp32: torch.Tensor | None = None
        self._with_shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        """(w1, w3, w2, w13) over E + 1 experts, the shared one last (pack_weights, when it has the routed
        experts' shape): steps whose backend ``folds_shared`` route it as expert E with weight 1.0."""
        self._shared_streams: tuple[torch.Tensor, torch.Tensor] | None = None
        """The folded shared expert's gate | up [2I, H] and down [H, I], each contiguous: what every step reads
        whatever the routing, so ``prefetch`` can ask for them before the route is known."""

    def pack_weights(self) -> None:
        """One [E (+1), 2I, H] gate | up tensor and one [E (+1), H, I] down tensor; a shared expert of the routed
        experts' shape is stored as expert E of both (its own weights become views: no extra memory)."""
        self._gate_fp32 = self.gate.weight.detach().float()  # the router runs in fp32: cast once, not per step
        ex, (e, i, h) = self.experts, self.experts.w1.shape
        sh = self.shared_experts
        fold = sh is not None and sh.gate_proj.weight.shape == (i, h) and sh.down_proj.weight.shape == (h, i)
        n = e + 1 if fold else e
        w13 = ex.w1.new_empty(n, 2 * i, h)
        w13[:e, :i], w13[:e, i:] = ex.w1.data, ex.w3.data
        w2 = ex.w2.data
        if fold:
            w2 = ex.w2.new_empty(n, h, i)
            w2[:e] = ex.w2.data
            w13[e, :i], w13[e, i:], w2[e] = sh.gate_proj.weight.data, sh.up_proj.weight.data, sh.down_proj.weight.data
            sh.gate_up = PackedProjection([sh.gate_proj, sh.up_proj], weight=w13[e])
            sh.down_proj.weight = nn.Parameter(w2[e], requires_grad=False)
            ex.w2 = nn.Parameter(w2[:e], requires_grad=False)
            self._with_shared = (w13[:, :i], w13[:, i:], w2, w13)
            self._shared_streams = (w13[e], w2[e])
        self.w13 = w13[:e]
        ex.w1 = nn.Parameter(w13[:e, :i], requires_grad=False)
        ex.w3 = nn.Parameter(w13[:e, i:], requires_grad=False)

    def prefetch(self, rows: int, be: Backends) -> None:
        """Ask ``be.l2`` for the folded shared expert's weights (the routed ones are known only after the route)."""
        if self._shared_streams is not None and be.moe.folds_shared(rows):
            be.l2.weights(rows, *self._shared_streams)

    def fuses_add_norm(self, rows: int, be: Backends) -> bool:
        """Whether ``forward(add_norm=...)`` runs the next norm in the experts' last launch at ``rows`` rows."""
        return self._with_shared is not None and be.moe.fuses_add_norm(rows)  # the backend's asks folds_shared

    def forward(self, x: torch.Tensor, be: Backends, add_norm: AddNorm | None = None):
        """The block's output [T, H]; with ``add_norm`` (where ``fuses_add_norm``) the next norm's pair instead."""
        fold = self._with_shared is not None and be.moe.folds_shared(x.shape[0])
        route = (
            self.gate.weight,
            self._gate_fp32,
            self.gate.e_score_correction_bias,
            self.cfg.num_experts_per_token,
            self.cfg.moe_renormalize,
            self.cfg.routed_scaling_factor,
        )
        if fold and add_norm is not None:  # the whole block, with the next norm, as the backend runs it
            be.l2.join()  # the shared expert's prefetch (``prefetch``), before anything reads it
            return be.moe.route_experts_add_norm(x, *route, self.experts.w1.shape[0], self._with_shared, add_norm)
        weights, ids = be.moe.route_hidden(x, *route, extra_expert=self.experts.w1.shape[0] if fold else None)
        be.l2.join()  # the shared expert's prefetch (``prefetch``), before the experts read it
        if fold:  # the shared expert is expert E, weight 1.0: summed with the routed ones in the same launches
            w1, w3, w2, w13 = self._with_shared
            return be.moe.experts(x, weights, ids, w1, w3, w2, w13=w13)
        if add_norm is not None:
            raise ValueError("add_norm needs the shared expert folded (fuses_add_norm is False for this step)")
        shared = self.shared_experts(x, be) if self.shared_experts is not None else None
        ex = self.experts
        return be.moe.experts(x, weights, ids, ex.w1, ex.w3, ex.w2, w13=self.w13, add=shared)  # routed + shared


class KimiDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        kind = cfg.layer_kinds[layer_idx]
        self.self_attn = KimiDeltaAttention(cfg, layer_idx) if kind == "kda" else KimiMLAAttention(cfg, layer_idx)
        self.is_moe = cfg.mlp_kinds[layer_idx] == "moe"
        if self.is_moe:
            self.block_sparse_moe = SparseMoE(cfg)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def feed_forward(self, x: torch.Tensor, be: Backends) -> torch.Tensor:
        return self.block_sparse_moe(x, be) if self.is_moe else self.mlp(x, be)

    def attention_input_weight(self, rows: int) -> torch.Tensor | None:
        return self.self_attn.input_weight(rows)

    def prefetch_feed_forward(self, rows: int, be: Backends) -> None:
        if self.is_moe:
            self.block_sparse_moe.prefetch(rows, be)

    def mlp_input_weight(self, rows: int) -> torch.Tensor | None:
        """The dense MLP's packed gate | up (a MoE block's input has several consumers: the router, the experts)."""
        return None if self.is_moe or self.mlp.gate_up is None else self.mlp.gate_up.weight

    def feed_forward_projected(self, projected: torch.Tensor, be: Backends) -> torch.Tensor:
        return self.mlp.from_gate_up(projected, be)

    def feed_forward_add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, be: Backends
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One-token GPU steps: a MoE layer's experts' combine runs the next norm (kernels/moe/combine_norm.py), a
        dense MLP's down projection does (kernels/gemv/norm_after.py)."""
        after = AddNorm(residual, norm.weight, norm.eps)
        if not self.is_moe:
            return self.mlp.add_norm(x, after, be)
        if not self.block_sparse_moe.fuses_add_norm(x.shape[0], be):
            return None
        return self.block_sparse_moe(x, be, add_norm=after)


class KimiLinearForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.model.layers = nn.ModuleList(KimiDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
