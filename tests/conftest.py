"""Shared fixtures: tiny checkpoints generated once per session, engines on CPU in fp32."""

from __future__ import annotations

import importlib.abc
import os
import sys
from pathlib import Path


class _BlockFla(importlib.abc.MetaPathFinder):
    """transformers must take its pure-torch Kimi-Linear path in tests: fla cannot run on CPU."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "fla" or name.startswith("fla."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked in tests)", name=name)


if not any(isinstance(f, _BlockFla) for f in sys.meta_path):
    sys.meta_path.insert(0, _BlockFla())
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.tiny_model import make_tiny_model  # noqa: E402

torch.set_num_threads(1)
ARCHS = ("kimi_linear", "qwen3")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(root / arch, arch=arch, seed=0) for arch in ARCHS}


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def model_dir(tiny_models: dict[str, Path], arch: str) -> Path:
    return tiny_models[arch]


def make_engine(model_dir: Path, **kw: object) -> LLMEngine:
    kw.setdefault("kv_cache_memory_bytes", 8 << 20)
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    return LLMEngine(EngineConfig(model=str(model_dir), **kw))  # type: ignore[arg-type]


def random_prompts(n: int, lengths: list[int], vocab: int = 512, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]
