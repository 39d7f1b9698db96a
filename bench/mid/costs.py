"""FLOP and byte models of one forward, from the ModelConfig and the loaded model.

Prefill FLOPs of one L-token prompt (forward only, 2 FLOPs per multiply-add):

    2 * L * (dense weights a token multiplies: every attention / KDA projection, MLA's kv_b (the expanded
             form applies it to every context token), the dense MLP, the MoE router, the shared expert and
             the top-k *active* experts only -- never all experts)
  + per MLA / GQA layer: 2 * L(L+1)/2 * heads * (d_qk + d_v)      (causal: the pairs actually attended)
  + per KDA layer:       6 * L * heads * K * V                      (the recurrence's three K x V products per
                                                                    token: S^T k, k u^T, S^T q; the chunked
                                                                    form's extra intra-chunk work not counted)
  + 2 * hidden * vocab                                              (LM head, the one sampled row)

Decode bytes of one step (batch B, every sequence at context C): what must cross HBM at least once:

    non-expert parameters (every layer's projections, norms, dense MLP, router, shared expert, LM head)
  + distinct routed experts touched per MoE layer (measured from the step's routing) * 3 * hidden * I * bytes
  + MLA: B * C * (kv_lora_rank + rope) * bytes per layer; GQA: B * C * 2 * kv_heads * head_dim * bytes
  + KDA: B * 2 * heads * K * V * 4 (fp32 state read and written) + conv window, per layer
Embedding rows and activations are left out (small next to these at the measured shapes).
"""

from __future__ import annotations

from torch import nn

from engine.model_config import ModelConfig


def _dense_weights_per_token(cfg: ModelConfig) -> float:
    h = cfg.hidden_size
    total = 0.0
    for kind, mlp in zip(cfg.layer_kinds, cfg.mlp_kinds, strict=True):
        if kind == "kda":
            p, hd, nh = cfg.kda_proj_dim, cfg.kda_head_dim, cfg.kda_num_heads
            total += 4 * h * p + 2 * (h * hd + hd * p) + h * nh
        elif kind == "mla":
            n, r, rope = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
            qk = cfg.qk_nope_head_dim + rope
            total += h * n * qk + h * (r + rope) + r * n * (cfg.qk_nope_head_dim + cfg.v_head_dim)
            total += n * cfg.v_head_dim * h
        else:  # gqa
            d = cfg.head_dim
            total += h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
        if mlp == "dense":
            total += 3 * h * cfg.intermediate_size
        else:
            i = cfg.moe_intermediate_size
            total += h * cfg.num_experts + 3 * h * i * (cfg.num_experts_per_token + cfg.num_shared_experts)
    return total


def attention_pairs(q_len: int, ctx: int) -> float:
    """Causal (query, key) pairs of q_len queries ending at position ctx - 1."""
    return q_len * ctx - q_len * (q_len - 1) / 2


def prefill_flops(cfg: ModelConfig, length: int) -> dict[str, float]:
    """FLOPs of one prompt's prefill by part; 'total' sums them (formula in the module docstring)."""
    pairs = attention_pairs(length, length)
    attn = 0.0
    kda = 0.0
    for kind in cfg.layer_kinds:
        if kind == "mla":
            d_qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            attn += 2 * pairs * cfg.num_attention_heads * (d_qk + cfg.v_head_dim)
        elif kind == "gqa":
            attn += 2 * pairs * cfg.num_attention_heads * 2 * cfg.head_dim
        else:
            kda += 6 * length * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim
    parts = {
        "weights": 2.0 * length * _dense_weights_per_token(cfg),
        "attention": attn,
        "kda": kda,
        "lm_head": 2.0 * cfg.hidden_size * cfg.vocab_size,
    }
    parts["total"] = sum(parts.values())
    return parts


def non_expert_param_bytes(model: nn.Module) -> int:
    """Bytes of every parameter a decode step reads in full: all but the routed experts and the embedding."""
    total = 0
    for name, p in model.named_parameters():
        if ".experts.w" in name or "embed_tokens" in name:
            continue
        total += p.numel() * p.element_size()
    return total


def decode_bytes(
    cfg: ModelConfig,
    model: nn.Module,
    batch: int,
    ctx: int,
    experts_touched: list[int],
    dtype_bytes: int = 2,
) -> dict[str, float]:
    """Bytes one decode step must move (module docstring); experts_touched: distinct experts per MoE layer."""
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * dtype_bytes
    kv = 0.0
    state = 0.0
    for kind in cfg.layer_kinds:
        if kind == "mla":
            kv += batch * ctx * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
        elif kind == "gqa":
            kv += batch * ctx * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
        else:
            rec = cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * 4
            conv = cfg.kda_proj_dim * 3 * (cfg.conv_kernel_size - 1) * dtype_bytes
            state += batch * 2 * (rec + conv)
    parts = {
        "weights": float(non_expert_param_bytes(model)),
        "experts": float(sum(experts_touched) * expert_bytes),
        "kv": kv,
        "kda_state": state,
    }
    parts["total"] = sum(parts.values())
    return parts
