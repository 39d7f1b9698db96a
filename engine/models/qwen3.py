"""Qwen3: GQA with per-head q/k RMSNorm and RoPE, dense SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import nn

from engine.backends import Backends
from engine.backends.base import AddNorm, QKNormRope
from engine.cache.tensors import CacheTensors
from engine.forward_batch import ForwardBatch
from engine.model_config import ModelConfig
from engine.models.base import CausalLM
from engine.models.layers import (
    GatedMLP,
    PackedProjection,
    PreNormDecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    project,
    project_norm_after,
)


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(self.head_dim, cfg.rope_theta)
        self.qkv: PackedProjection | None = None

    def pack_weights(self) -> None:
        self.qkv = PackedProjection([self.q_proj, self.k_proj, self.v_proj])

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cache: CacheTensors, be: Backends, norm_after: AddNorm | None = None
    ):
        """x [T, hidden] -> the output [T, hidden], or with ``norm_after`` the pair of the norm after it
        (``project_norm_after``)."""
        t = x.shape[0]
        if self.qkv is not None:
            q, k, v = self.qkv(x, be).split(self.qkv.sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        be.l2.weights(t, self.o_proj.weight)  # read after the norms, the cache write and the attention
        q = q.reshape(t, self.num_heads, self.head_dim)
        k, v = (x.reshape(t, self.num_kv_heads, self.head_dim) for x in (k, v))
        kv_pages = cache.kv[self.layer_idx]
        assert self.q_norm.eps == self.k_norm.eps  # one config value
        qk = QKNormRope(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.rotary, self.rotary.inv_freq)
        q = be.attention.gqa_qk_norm_rope_write(kv_pages, batch, q, k, v, qk, be.norm)
        o = be.attention.gqa(q, kv_pages, batch, self.scale)
        be.l2.join()
        if norm_after is not None:
            return project_norm_after(o.reshape(t, -1), self.o_proj.weight, norm_after, be)
        return project(o.reshape(t, -1), self.o_proj.weight, be)


class Qwen3DecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, layer_idx)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def feed_forward(self, x: torch.Tensor, be: Backends) -> torch.Tensor:
        return self.mlp(x, be)

    def feed_forward_add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, be: Backends
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One-row GPU steps: the down projection's last program runs the next norm (kernels/gemv/norm_after.py)."""
        return self.mlp.add_norm(x, AddNorm(residual, norm.weight, norm.eps), be)


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.model.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
