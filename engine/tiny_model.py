"""Deterministic tiny Hugging Face-format checkpoints for tests.

Writes a real HF model directory (config, safetensors weights, tokenizer files, generation config)
for a scaled-down Kimi-Linear or Qwen3 model. Everything is byte-for-byte reproducible for a given
(arch, seed, dtype, num_shards, preset), so tests can compare implementations token-for-token.

Deliberately does not import transformers: the engine must be able to build fixtures without it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SUPPORTED_TINY_ARCHS = ("kimi_linear", "qwen3")
SUPPORTED_PRESETS = ("tiny", "deep", "mla512")
"""'deep': 8 layers and 4 attention / KDA heads, so both families run pp up to 8 and tp up to 4.
'mla512' (Kimi-Linear only): the tiny model with the real MLA latent (kv_lora_rank 512, rope 64), the one
shape FlashMLA's decode kernel takes (bench/gpu_agreement.py --preset mla512 --page-size 64)."""

VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|im_end|>", "<|im_start|>")  # ids 0..3
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
MODEL_MAX_LENGTH = 4096

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Init scales. Why: these models back token-exact greedy comparisons between implementations that
# differ by ~1e-6 in fp32, so logits must be "peaky" (large top1-top2 gaps). Hidden activations are
# kept O(1) (std ~1/sqrt(fan_in) linears, unit-ish embeddings) and the lm_head is scaled up so logit
# std is ~LM_HEAD_GAIN (ties between the top two tokens become rare).
EMBED_STD = 1.0
LINEAR_GAIN = 1.0  # std = LINEAR_GAIN / sqrt(fan_in)
LM_HEAD_GAIN = 8.0  # std = LM_HEAD_GAIN / sqrt(hidden) -> logits std ~8 after the final RMSNorm
NORM_JITTER = 0.1  # norm weights are 1 + 0.1*N(0,1) so a swapped/missing norm changes outputs
BIAS_STD = 0.1  # router e_score_correction_bias: nonzero so misuse of it is detectable
CONV_STD = 0.5
FORGET_GAIN = 0.5  # keep KDA forget gate input near dt_bias -> slow-ish, input-dependent decay

# A small fixed English corpus for BPE training (only needs to yield >= 252 merges).
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving system takes requests from many users,
batches them together, and runs the model on an accelerator. Each request carries a prompt, a few
sampling parameters, and a limit on the number of new tokens. The scheduler decides which requests
run in the next step, and the cache manager keeps track of the memory that holds keys and values.

When the weather is warm, people walk along the river and talk about their plans for the summer.
Some of them read books in the shade of the old trees, while others play music or sell fresh bread,
cheese, apples, and cold drinks. In the evening the lights come on and the city becomes quiet again.

Numbers matter too: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100, 256, 1024, and 3.14159 appear in
many documents. Dates such as 2024-06-01 and times like 12:30 are common, as are prices of $19.99.

def greet(name):
    return "Hello, " + name + "!"

for i in range(10):
    print(greet(str(i)))

Language models predict the next token given the previous ones. Greedy decoding always picks the
most likely token, while sampling draws from the distribution after temperature, top-k, and top-p
filters. Streaming returns text as it is produced, which makes the interface feel responsive. A
good engine should be fast, correct, and predictable, and it should handle long contexts, short
questions, and everything in between without wasting memory or time.

Mountains, forests, oceans, and deserts cover the surface of the planet. Scientists measure the
temperature of the water, the speed of the wind, and the height of the clouds. They share their
results in papers, talks, and open data sets so that others can check and extend their work.
"""


def _kimi_config(dtype: str) -> dict[str, Any]:
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 2.446,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "model_max_length": MODEL_MAX_LENGTH,
        "num_nextn_predict_layers": 0,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "linear_attn_config": {
            "head_dim": 32,
            "num_heads": 2,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 2, 3],  # 1-based, as in the real checkpoint
            "full_attn_layers": [4],
        },
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def _qwen3_config(dtype: str) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        # Flat rope_theta for plain JSON readers; rope_parameters is what transformers 5 reads.
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": MODEL_MAX_LENGTH,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 4,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def _apply_preset(cfg: dict[str, Any], preset: str) -> None:
    if preset == "mla512":
        if cfg["model_type"] != "kimi_linear":
            raise ValueError("preset 'mla512' is for kimi_linear (Qwen3 has no MLA)")
        cfg["kv_lora_rank"], cfg["qk_rope_head_dim"] = 512, 64
        return
    if preset != "deep":
        return
    cfg["num_hidden_layers"] = 8
    if cfg["model_type"] == "kimi_linear":
        cfg["num_attention_heads"] = cfg["num_key_value_heads"] = 4
        lin = cfg["linear_attn_config"]
        lin["num_heads"] = 4
        lin["kda_layers"], lin["full_attn_layers"] = [1, 2, 3, 5, 6, 7], [4, 8]  # 3:1, as the real model
    else:
        cfg["max_window_layers"] = 8


class _Init:
    """Draws tensors in a fixed order from one local generator (never the global RNG)."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.tensors: dict[str, torch.Tensor] = {}

    def normal(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> None:
        t = torch.randn(shape, generator=self.gen, dtype=torch.float32)
        self.tensors[name] = t * std + mean

    def uniform(self, shape: tuple[int, ...], lo: float, hi: float) -> torch.Tensor:
        return torch.rand(shape, generator=self.gen, dtype=torch.float32) * (hi - lo) + lo

    def linear(self, name: str, out_f: int, in_f: int, gain: float = LINEAR_GAIN) -> None:
        self.normal(name, (out_f, in_f), gain / math.sqrt(in_f))

    def norm(self, name: str, n: int) -> None:
        self.normal(name, (n,), NORM_JITTER, mean=1.0)


def _embed_and_head(init: _Init, cfg: dict[str, Any], head: bool) -> None:
    v, h = cfg["vocab_size"], cfg["hidden_size"]
    if not head:
        init.normal("model.embed_tokens.weight", (v, h), EMBED_STD)
        return
    init.norm("model.norm.weight", h)
    init.linear("lm_head.weight", v, h, gain=LM_HEAD_GAIN)


def _mlp(init: _Init, p: str, h: int, i: int, names: tuple[str, str, str]) -> None:
    gate, up, down = names
    init.linear(f"{p}.{gate}.weight", i, h)
    init.linear(f"{p}.{up}.weight", i, h)
    init.linear(f"{p}.{down}.weight", h, i)


def _kimi_weights(init: _Init, cfg: dict[str, Any]) -> None:
    h, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    lin = cfg["linear_attn_config"]
    nh, hd, ks = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    proj = nh * hd
    kda = {i - 1 for i in lin["kda_layers"]}
    n, nope, rope, vh = (
        cfg["num_attention_heads"],
        cfg["qk_nope_head_dim"],
        cfg["qk_rope_head_dim"],
        cfg["v_head_dim"],
    )
    rank, n_exp = cfg["kv_lora_rank"], cfg["num_experts"]
    im = cfg["moe_intermediate_size"]
    _embed_and_head(init, cfg, head=False)
    for i in range(n_layers):
        p = f"model.layers.{i}"
        init.norm(f"{p}.input_layernorm.weight", h)
        init.norm(f"{p}.post_attention_layernorm.weight", h)
        a = f"{p}.self_attn"
        if i in kda:
            for x in ("q", "k", "v"):
                init.linear(f"{a}.{x}_proj.weight", proj, h)
            for x in ("q", "k", "v"):
                init.normal(f"{a}.{x}_conv1d.weight", (proj, 1, ks), CONV_STD)
            init.linear(f"{a}.f_a_proj.weight", hd, h, gain=FORGET_GAIN)
            init.linear(f"{a}.f_b_proj.weight", proj, hd, gain=FORGET_GAIN)
            # FLA init: dt ~ logU(1e-3, 1e-1), stored as inverse-softplus; A ~ U(1, 16) as log.
            dt = init.uniform((proj,), math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            init.tensors[f"{a}.dt_bias"] = dt + torch.log(-torch.expm1(-dt))
            init.tensors[f"{a}.A_log"] = init.uniform((1, 1, nh, 1), 1.0, 16.0).log()
            init.linear(f"{a}.b_proj.weight", nh, h)
            init.linear(f"{a}.g_a_proj.weight", hd, h)
            init.linear(f"{a}.g_b_proj.weight", proj, hd)
            init.norm(f"{a}.o_norm.weight", hd)
            init.linear(f"{a}.o_proj.weight", h, proj)
        else:
            init.linear(f"{a}.q_proj.weight", n * (nope + rope), h)
            init.linear(f"{a}.kv_a_proj_with_mqa.weight", rank + rope, h)
            init.norm(f"{a}.kv_a_layernorm.weight", rank)
            init.linear(f"{a}.kv_b_proj.weight", n * (nope + vh), rank)
            init.linear(f"{a}.o_proj.weight", h, n * vh)
        if i < cfg["first_k_dense_replace"]:
            _mlp(init, f"{p}.mlp", h, cfg["intermediate_size"], ("gate_proj", "up_proj", "down_proj"))
            continue
        m = f"{p}.block_sparse_moe"
        init.linear(f"{m}.gate.weight", n_exp, h)
        init.normal(f"{m}.gate.e_score_correction_bias", (n_exp,), BIAS_STD)
        for j in range(n_exp):
            _mlp(init, f"{m}.experts.{j}", h, im, ("w1", "w3", "w2"))
        _mlp(
            init,
            f"{m}.shared_experts",
            h,
            im * cfg["num_shared_experts"],
            ("gate_proj", "up_proj", "down_proj"),
        )
    _embed_and_head(init, cfg, head=True)


def _qwen3_weights(init: _Init, cfg: dict[str, Any]) -> None:
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    _embed_and_head(init, cfg, head=False)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        init.norm(f"{p}.input_layernorm.weight", h)
        init.norm(f"{p}.post_attention_layernorm.weight", h)
        a = f"{p}.self_attn"
        init.linear(f"{a}.q_proj.weight", nq * hd, h)
        init.linear(f"{a}.k_proj.weight", nkv * hd, h)
        init.linear(f"{a}.v_proj.weight", nkv * hd, h)
        init.linear(f"{a}.o_proj.weight", h, nq * hd)
        init.norm(f"{a}.q_norm.weight", hd)
        init.norm(f"{a}.k_norm.weight", hd)
        _mlp(init, f"{p}.mlp", h, cfg["intermediate_size"], ("gate_proj", "up_proj", "down_proj"))
    _embed_and_head(init, cfg, head=True)


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE with vocab exactly VOCAB_SIZE; specials first, then 256 bytes, then merges."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:  # corpus too small would silently shrink the vocab
        raise RuntimeError(f"tokenizer vocab {tok.get_vocab_size()} != {VOCAB_SIZE}")
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s} not at id {i}")
    return tok


def _dump_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n")


def _write_tokenizer(out: Path) -> None:
    tok_json = json.loads(build_tokenizer().to_str())
    _dump_json(out / "tokenizer.json", tok_json)
    _dump_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|bos|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|pad|>",
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MODEL_MAX_LENGTH,
            "chat_template": CHAT_TEMPLATE,
            "additional_special_tokens": ["<|im_start|>"],
        },
    )
    _dump_json(
        out / "special_tokens_map.json",
        {
            "bos_token": "<|bos|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|pad|>",
            "additional_special_tokens": ["<|im_start|>"],
        },
    )


def _write_weights(out: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    names = list(tensors)  # build order: embeddings, layer 0..N-1, final norm, lm_head
    if not 1 <= num_shards <= len(names):
        raise ValueError(f"num_shards must be in [1, {len(names)}], got {num_shards}")
    meta = {"format": "pt"}
    if num_shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata=meta)
        return
    weight_map: dict[str, str] = {}
    for k in range(num_shards):
        chunk = names[k * len(names) // num_shards : (k + 1) * len(names) // num_shards]
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(out / fname), metadata=meta)
        weight_map.update({n: fname for n in chunk})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _dump_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "kimi_linear",
    seed: int = 0,
    dtype: str = "float32",
    num_shards: int = 1,
    preset: str = "tiny",
) -> Path:
    """Write a deterministic tiny HF checkpoint for `arch` into `out_dir`; returns the path."""
    if arch not in SUPPORTED_TINY_ARCHS:
        raise ValueError(f"unsupported arch {arch!r}; expected one of {SUPPORTED_TINY_ARCHS}")
    if preset not in SUPPORTED_PRESETS:
        raise ValueError(f"unsupported preset {preset!r}; expected one of {SUPPORTED_PRESETS}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")

    cfg = _kimi_config(dtype) if arch == "kimi_linear" else _qwen3_config(dtype)
    _apply_preset(cfg, preset)
    init = _Init(seed)
    (_kimi_weights if arch == "kimi_linear" else _qwen3_weights)(init, cfg)
    # Weights are always drawn in fp32 then cast, so bf16 is a rounding of the fp32 model.
    tensors = {k: v.to(torch_dtype).contiguous() for k, v in init.tensors.items()}

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Remove stale weight files so a re-run with a different num_shards leaves a valid directory.
    for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    _dump_json(out / "config.json", cfg)
    _write_weights(out, tensors, num_shards)
    _write_tokenizer(out)
    _dump_json(
        out / "generation_config.json",
        {
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "pad_token_id": PAD_ID,
        },
    )
    return out
