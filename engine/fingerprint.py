"""What a producer and a consumer must share for transferred state to mean the same thing."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.loader import checkpoint_files
from engine.model_config import ModelConfig

_FULL_HASH_LIMIT = 1 << 30  # files above this are sampled, not read whole (startup time)
_SAMPLE = 1 << 20
_STRIDE = 256 << 20


@dataclass(frozen=True)
class Fingerprint:
    model_digest: str
    tokenizer_digest: str
    dtype: str
    page_size: int
    cache_layout: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(
            "|".join(
                [self.model_digest, self.tokenizer_digest, self.dtype, str(self.page_size), self.cache_layout]
            ).encode()
        ).hexdigest()

    def differences(self, other: Fingerprint) -> list[str]:
        names = ("model_digest", "tokenizer_digest", "dtype", "page_size", "cache_layout")
        return [
            f"{n}: {getattr(self, n)} != {getattr(other, n)}" for n in names if getattr(self, n) != getattr(other, n)
        ]


def _file_digest(h: hashlib._Hash, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        if size <= _FULL_HASH_LIMIT:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
            return
        for off in range(0, size, _STRIDE):  # safetensors header is at offset 0, always included
            f.seek(off)
            h.update(f.read(_SAMPLE))


def model_digest(model_dir: str | Path) -> str:
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    h.update(json.dumps(json.loads((model_dir / "config.json").read_text()), sort_keys=True).encode())
    for f in checkpoint_files(model_dir):
        _file_digest(h, f)
    return h.hexdigest()


def cache_layout(cfg: ModelConfig) -> str:
    kinds = ",".join(cfg.layer_kinds)
    return (
        f"layers=[{kinds}];kv_entry={list(cfg.kv_entry_shape)};"
        f"kda=h{cfg.kda_num_heads}k{cfg.kda_head_dim}w{cfg.conv_kernel_size};state=fp32"
    )


def compute_fingerprint(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, page_size: int) -> Fingerprint:
    tok = Path(model_dir) / "tokenizer.json"
    tok_digest = hashlib.sha256(tok.read_bytes()).hexdigest() if tok.is_file() else "none"
    return Fingerprint(
        model_digest=model_digest(model_dir),
        tokenizer_digest=tok_digest,
        dtype=str(dtype).removeprefix("torch."),
        page_size=page_size,
        cache_layout=cache_layout(cfg),
    )
