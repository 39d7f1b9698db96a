"""Fixtures of the multi-rank tests: the 'deep' tiny checkpoints (8 layers, 4 heads) for pp=8 / tp=4."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.tiny_model import make_tiny_model
from tests.conftest import ARCHS


@pytest.fixture(scope="session")
def models(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """'kimi_linear' / 'qwen3' (4 layers) and 'deep-kimi_linear' / 'deep-qwen3' (8 layers, 4 heads)."""
    root = tmp_path_factory.mktemp("deep-models")
    deep = {f"deep-{a}": make_tiny_model(root / a, arch=a, seed=0, preset="deep") for a in ARCHS}
    return {**tiny_models, **deep}
