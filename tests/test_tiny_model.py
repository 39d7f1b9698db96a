"""Tests for engine.tiny_model: determinism, file layout, and loadability by HF transformers."""

from __future__ import annotations

import json
from pathlib import Path

# fla is blocked for the whole session in conftest.py (transformers' pure-torch path).
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.tiny_model import (
    BOS_ID,
    SUPPORTED_TINY_ARCHS,
    build_tokenizer,
    make_tiny_model,
)

FILES = (
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _read_all(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _load_tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                assert k not in out, f"tensor {k} stored twice"
                out[k] = sf.get_tensor(k)
    return out


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {a: make_tiny_model(root / a, arch=a) for a in SUPPORTED_TINY_ARCHS}


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_deterministic_files(tmp_path: Path, models_dir: dict[str, Path], arch: str) -> None:
    again = _read_all(make_tiny_model(tmp_path / "a", arch=arch, seed=0))
    first = _read_all(models_dir[arch])
    assert set(first) == {*FILES, "model.safetensors"}
    assert again == first
    other = _read_all(make_tiny_model(tmp_path / "b", arch=arch, seed=1))
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]


def test_tokenizer_training_deterministic() -> None:
    assert build_tokenizer().to_str() == build_tokenizer().to_str()


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_sharded_bf16(tmp_path: Path, models_dir: dict[str, Path], arch: str) -> None:
    d = make_tiny_model(tmp_path / "s", arch=arch, dtype="bfloat16", num_shards=3)
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((d / "model.safetensors.index.json").read_text())
    tensors = _load_tensors(d)
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == set(shards)
    for name, fname in index["weight_map"].items():
        with safe_open(str(d / fname), framework="pt") as sf:
            assert name in sf.keys()  # noqa: SIM118
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["metadata"]["total_size"] == total
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    # bf16 is the rounding of the fp32 model with the same seed.
    ref = _load_tensors(models_dir[arch])
    assert set(ref) == set(tensors)
    for k, v in ref.items():
        assert v.dtype == torch.float32
        assert torch.equal(v.to(torch.bfloat16), tensors[k]), k


def test_kimi_config_fields(models_dir: dict[str, Path]) -> None:
    cfg = json.loads((models_dir["kimi_linear"] / "config.json").read_text())
    assert cfg["linear_attn_config"] == {
        "head_dim": 32,
        "num_heads": 2,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 3],
        "full_attn_layers": [4],
    }
    assert cfg["q_lora_rank"] is None and cfg["first_k_dense_replace"] == 1
    names = set(_load_tensors(models_dir["kimi_linear"]))
    assert "model.layers.0.self_attn.A_log" in names
    assert "model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
    assert "model.layers.1.block_sparse_moe.gate.e_score_correction_bias" in names


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_transformers_loads(models_dir: dict[str, Path], arch: str) -> None:
    model, info = AutoModelForCausalLM.from_pretrained(models_dir[arch], dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]
    n_params = sum(p.numel() for p in model.parameters())
    assert 200_000 <= n_params <= 2_000_000, n_params
    cfg = model.config
    if arch == "kimi_linear":
        assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
        assert cfg.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
        assert cfg.num_local_experts == 4 and cfg.num_experts_per_tok == 2
        assert cfg.linear_num_heads == 2 and cfg.linear_head_dim == 32
        # The checkpoint's nonzero router bias must survive the name conversion.
        bias = model.model.layers[1].mlp.gate.e_score_correction_bias
        assert bias.abs().sum() > 0
    else:
        assert cfg.rope_parameters["rope_theta"] == 10000.0
        assert cfg.rope_parameters["rope_type"] == "default"
    # Peakiness smoke check: greedy top1-top2 logit gaps are large (see module docstring).
    prompt = torch.tensor([[17, 200, 33, 401, 99, 250]])
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=24,
            min_new_tokens=24,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    gaps = torch.stack([torch.topk(s[0], 2).values for s in out.scores])
    gaps = gaps[:, 0] - gaps[:, 1]
    assert gaps.median() > 0.5, gaps
    assert len(set(out.sequences[0, 6:].tolist())) > 4  # no immediate single-token collapse


def test_transformers_loads_sharded_bf16(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "s", arch="kimi_linear", dtype="bfloat16", num_shards=3)
    _model, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_hf_tokenizer(models_dir: dict[str, Path], arch: str) -> None:
    tok = AutoTokenizer.from_pretrained(models_dir[arch])
    assert len(tok) == 512
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.convert_tokens_to_ids("<|im_start|>") == 3
    assert tok.model_max_length == 4096
    for s in (
        "Hello, world!",
        "  spaces\tand\nnewlines ",
        "naïve café 🚀 数字 123",
        "<|im_start|>user\nhi<|im_end|>",
    ):
        ids = tok(s)["input_ids"]
        assert BOS_ID not in ids  # add_bos_token is false
        assert tok.decode(ids) == s
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # BatchEncoding in transformers 5
    assert ids[0] == 3 and ids.count(2) == 2
    assert tok.decode(ids) == text
    gen = json.loads((models_dir[arch] / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def test_mla512_preset(tmp_path: Path) -> None:
    """The real MLA latent on the tiny Kimi model; Qwen3 has no MLA to widen."""
    cfg = json.loads((make_tiny_model(tmp_path / "k", arch="kimi_linear", preset="mla512") / "config.json").read_text())
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (512, 64)
    with pytest.raises(ValueError, match="mla512"):
        make_tiny_model(tmp_path / "q", arch="qwen3", preset="mla512")
