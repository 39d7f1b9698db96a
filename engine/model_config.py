"""The model's architecture as read from an HF ``config.json``: one typed, frozen description."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# HF ``architectures`` name -> our model family.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "KimiLinearForCausalLM": "kimi_linear",
    "Qwen3ForCausalLM": "qwen3",
}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts the engine needs. Layer kinds are 0-based: 'kda' | 'mla' | 'gqa'."""

    family: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    layer_kinds: tuple[str, ...]
    mlp_kinds: tuple[str, ...]  # 'dense' | 'moe'
    intermediate_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    torch_dtype: str
    # attention (GQA for Qwen3; head counts also used by MLA)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0
    rope_theta: float = 10000.0
    # MLA
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # KDA
    kda_num_heads: int = 0
    kda_head_dim: int = 0
    conv_kernel_size: int = 0
    # MoE
    num_experts: int = 0
    num_experts_per_token: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k in ("mla", "gqa"))

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == "kda")

    @property
    def kv_entry_shape(self) -> tuple[int, ...]:
        """Per-token cache entry of one attention layer (MLA: latent + k_pe; GQA: K and V per head)."""
        if self.family == "kimi_linear":
            return (self.kv_lora_rank + self.qk_rope_head_dim,)
        return (2, self.num_key_value_heads, self.head_dim)

    @property
    def kda_proj_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _kimi_linear(c: dict[str, Any]) -> dict[str, Any]:
    n = c["num_hidden_layers"]
    la = c.get("linear_attn_config") or {}
    kinds = ["mla"] * n
    for one_based in la.get("kda_layers", []):
        if not 1 <= one_based <= n:
            raise ValueError(f"linear_attn_config.kda_layers has layer {one_based}, outside 1..{n}")
        kinds[one_based - 1] = "kda"
    for one_based in la.get("full_attn_layers", []):
        if kinds[one_based - 1] == "kda":
            raise ValueError(f"layer {one_based} is in both kda_layers and full_attn_layers")
    if not c.get("mla_use_nope", True):
        raise UnsupportedModelError("Kimi-Linear with mla_use_nope=false (rotary MLA) is not supported")
    if c.get("q_lora_rank") is not None:
        raise UnsupportedModelError("Kimi-Linear with q_lora_rank set is not supported")
    dense = c.get("first_k_dense_replace", 1)
    freq = c.get("moe_layer_freq", 1)
    has_moe = c.get("num_experts", 0) > 0
    mlp = ["moe" if has_moe and i >= dense and (i - dense) % freq == 0 else "dense" for i in range(n)]
    return dict(
        layer_kinds=tuple(kinds),
        mlp_kinds=tuple(mlp),
        num_key_value_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        max_position_embeddings=c.get("model_max_length", c.get("max_position_embeddings", 4096)),
        kv_lora_rank=c["kv_lora_rank"],
        qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"],
        kda_num_heads=la.get("num_heads", 0),
        kda_head_dim=la.get("head_dim", 0),
        conv_kernel_size=la.get("short_conv_kernel_size", 4),
        num_experts=c.get("num_experts", 0),
        num_experts_per_token=c.get("num_experts_per_token", 0),
        num_shared_experts=c.get("num_shared_experts", 0),
        moe_intermediate_size=c.get("moe_intermediate_size", 0),
        routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        moe_renormalize=bool(c.get("moe_renormalize", True)),
    )


def _qwen3(c: dict[str, Any]) -> dict[str, Any]:
    n = c["num_hidden_layers"]
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise UnsupportedModelError(f"Qwen3 rope type {rope.get('rope_type')!r} is not supported")
    return dict(
        layer_kinds=("gqa",) * n,
        mlp_kinds=("dense",) * n,
        num_key_value_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        max_position_embeddings=c.get("max_position_embeddings", 4096),
    )


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a model directory needs an HF config.json")
    c = json.loads(path.read_text())
    archs = c.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported architecture {archs!r} in {path}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    specific = _kimi_linear(c) if family == "kimi_linear" else _qwen3(c)
    return ModelConfig(
        family=family,
        architecture=arch,
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        num_hidden_layers=c["num_hidden_layers"],
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        intermediate_size=c.get("intermediate_size", 0),
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=_eos_ids(c.get("eos_token_id")),
        pad_token_id=c.get("pad_token_id"),
        torch_dtype=str(c.get("torch_dtype") or c.get("dtype") or "float32"),
        num_attention_heads=c["num_attention_heads"],
        raw=c,
        **specific,
    )
