"""Fixtures of the multi-rank tests: the 'deep' tiny checkpoints (8 layers, 4 heads) for pp=8 / tp=4."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from engine.tiny_model import make_tiny_model
from tests.conftest import ARCHS


@pytest.fixture(scope="session")
def models(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """'kimi_linear' / 'qwen3' (4 layers), 'deep-kimi_linear' / 'deep-qwen3' (8 layers, 4 heads) and
    'tied-qwen3' (the tiny Qwen3 with its LM head tied to the embedding, as small Qwen3 checkpoints are)."""
    root = tmp_path_factory.mktemp("deep-models")
    deep = {f"deep-{a}": make_tiny_model(root / a, arch=a, seed=0, preset="deep") for a in ARCHS}
    tied = root / "tied-qwen3"
    shutil.copytree(tiny_models["qwen3"], tied)
    cfg = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    weights = load_file(tied / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tied / "model.safetensors", metadata={"format": "pt"})
    return {**tiny_models, **deep, "tied-qwen3": tied}
