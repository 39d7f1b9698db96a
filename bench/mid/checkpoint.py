"""Mid-shape HF checkpoints for the GPU benchmarks: real per-layer shapes, few layers, random bf16 weights.

    python -m bench.mid.checkpoint --arch kimi_linear --out /tmp/mid-kimi [--layers 8] [--tiny]

Kimi-Linear mid: the Kimi-Linear-48B-A3B layer (hidden 2304, 32 KDA heads x 128, MLA 32 heads with
kv_lora_rank 512 + rope 64, nope 128, v 128, 256 experts top-8 of 1024 + 1 shared, first layer dense with
intermediate 9216, vocab 163840), KDA:MLA 3:1 as the real model (1-based full-attention layers 4, 8, ...).
Qwen3 mid: the Qwen3-8B layer (hidden 4096, 32 q / 8 kv heads x 128, intermediate 12288, vocab 151936).
``--tiny`` keeps the tiny test shapes (CPU verification) with the same long length limit.

Reuses engine/tiny_model.py's tensor naming and init scales; tensors are drawn on the GPU when there is one
(12.7 B expert weights at 8 layers would take minutes on the host) and streamed into ~2 GiB shards, so host
memory holds one shard at a time. Both our loader and transformers' ``*ForCausalLM`` read the directory.
A finished directory carries a stamp of its spec and is reused as is.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine import tiny_model as tm

MAX_LEN = 131072
"""Length limit written into the config: 64k prompts plus decode room, with margin."""
STAMP = "tandem_mid_spec.json"


@dataclass(frozen=True)
class MidSpec:
    arch: str  # 'kimi_linear' | 'qwen3'
    layers: int = 8
    tiny: bool = False
    seed: int = 0
    dtype: str = "bfloat16"


KIMI_LINEAR_SHAPES = dict(
    vocab_size=163840,
    hidden_size=2304,
    intermediate_size=9216,
    num_attention_heads=32,
    num_key_value_heads=32,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
)
"""Kimi-Linear-48B's per-layer shapes (the names are both HF config keys and ModelConfig fields); KDA: 32 heads
x 128 (``linear_attn_config``)."""


def kimi_config(spec: MidSpec) -> dict[str, Any]:
    cfg = tm._kimi_config(spec.dtype)
    cfg["model_max_length"] = MAX_LEN
    cfg["num_hidden_layers"] = spec.layers
    full = [i for i in range(1, spec.layers + 1) if i % 4 == 0] or [spec.layers]
    cfg["linear_attn_config"]["full_attn_layers"] = full
    cfg["linear_attn_config"]["kda_layers"] = [i for i in range(1, spec.layers + 1) if i not in full]
    if spec.tiny:
        return cfg
    cfg.update(
        **KIMI_LINEAR_SHAPES,
        moe_intermediate_size=1024,
        num_experts=256,
        num_experts_per_token=8,
        num_shared_experts=1,
    )
    cfg["linear_attn_config"].update(head_dim=128, num_heads=32)
    return cfg


def qwen3_config(spec: MidSpec) -> dict[str, Any]:
    cfg = tm._qwen3_config(spec.dtype)
    cfg.update(max_position_embeddings=MAX_LEN, num_hidden_layers=spec.layers, max_window_layers=spec.layers)
    if spec.tiny:
        return cfg
    cfg.update(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    )
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    cfg["rope_theta"] = 1000000.0
    return cfg


class _ShardSink(dict):
    """Receives tensors in build order, casts them, and flushes a safetensors shard every ~shard_bytes."""

    def __init__(self, out: Path, dtype: torch.dtype, shard_bytes: int) -> None:
        super().__init__()
        self.out, self.dtype, self.shard_bytes = out, dtype, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.weight_map: dict[str, str] = {}
        self.files: list[str] = []
        self.total = 0

    def __setitem__(self, name: str, t: torch.Tensor) -> None:
        t = t.to(self.dtype).contiguous().cpu()
        self.pending[name] = t
        self.pending_bytes += t.numel() * t.element_size()
        if self.pending_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        fname = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, str(self.out / fname), metadata={"format": "pt"})
        self.files.append(fname)
        self.weight_map.update(dict.fromkeys(self.pending, fname))
        self.total += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0


class _DeviceInit(tm._Init):
    """tiny_model's initialiser, drawing on `device` (fp32) and handing every tensor to the sink."""

    def __init__(self, seed: int, device: torch.device, sink: _ShardSink) -> None:
        self.gen = torch.Generator(device).manual_seed(seed)
        self.device = device
        self.tensors = sink

    def normal(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> None:
        t = torch.randn(shape, generator=self.gen, dtype=torch.float32, device=self.device)
        self.tensors[name] = t * std + mean

    def uniform(self, shape: tuple[int, ...], lo: float, hi: float) -> torch.Tensor:
        return torch.rand(shape, generator=self.gen, dtype=torch.float32, device=self.device) * (hi - lo) + lo


def write_mid_model(out_dir: str | Path, spec: MidSpec, device: str = "auto", shard_bytes: int = 2 << 30) -> Path:
    """Write (or reuse) the checkpoint of `spec` in `out_dir`; returns the path."""
    out = Path(out_dir)
    stamp = out / STAMP
    if stamp.is_file() and json.loads(stamp.read_text()) == asdict(spec):
        return out
    if spec.arch not in tm.SUPPORTED_TINY_ARCHS:
        raise ValueError(f"unsupported arch {spec.arch!r}; expected one of {tm.SUPPORTED_TINY_ARCHS}")
    out.mkdir(parents=True, exist_ok=True)
    for old in [stamp, *out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    dev = torch.device(
        "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device
    )
    cfg = kimi_config(spec) if spec.arch == "kimi_linear" else qwen3_config(spec)
    sink = _ShardSink(out, getattr(torch, spec.dtype), shard_bytes)
    init = _DeviceInit(spec.seed, dev, sink)
    (tm._kimi_weights if spec.arch == "kimi_linear" else tm._qwen3_weights)(init, cfg)
    sink.flush()
    tm._dump_json(
        out / "model.safetensors.index.json", {"metadata": {"total_size": sink.total}, "weight_map": sink.weight_map}
    )
    tm._dump_json(out / "config.json", cfg)
    tm._write_tokenizer(out)
    tm._dump_json(out / "generation_config.json", {"bos_token_id": tm.BOS_ID, "eos_token_id": tm.EOS_ID})
    stamp.write_text(json.dumps(asdict(spec)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mid.checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="kimi_linear", choices=tm.SUPPORTED_TINY_ARCHS)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="auto")
    a = p.parse_args(argv)
    path = write_mid_model(a.out, MidSpec(a.arch, a.layers, a.tiny), a.device)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
