"""Load an HF checkpoint directory: config.json + one or many *.safetensors (with their index)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.model_config import ModelConfig, load_model_config
from engine.models.base import CausalLM
from engine.models.registry import build_model

# Per-expert checkpoint tensors are stacked into one [E, ...] parameter.
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<idx>\d+)\.(?P<w>w[123])\.weight$")
_IGNORED = re.compile(r"(rotary_emb\.inv_freq)$")


class CheckpointError(ValueError):
    pass


WeightTransform = Callable[[str, torch.Tensor, bool], "tuple[str, torch.Tensor] | None"]
"""(parameter name, checkpoint tensor, is one expert's slice) -> (parameter name, tensor to load), or
None to skip it. A pipeline stage skips other stages' layers; a tensor-parallel rank takes its shard."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f} is listed in the index but missing")
    return files


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def resolve_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    if name == "auto":
        name = cfg.torch_dtype if cfg.torch_dtype in ("float32", "bfloat16", "float16") else "float32"
    return getattr(torch, name)


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, progress: bool = False
) -> tuple[CausalLM, ModelConfig]:
    model_dir = Path(model_dir)
    cfg = load_model_config(model_dir)
    with torch.device(device), _default_dtype(dtype):
        model = build_model(cfg)
    load_weights(model, checkpoint_files(model_dir), progress=progress)
    return model.eval().requires_grad_(False), cfg


def load_weights(
    model: CausalLM, files: list[Path], progress: bool = False, transform: WeightTransform | None = None
) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    expert_loaded: dict[str, set[int]] = {}
    names: list[tuple[Path, str]] = []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            names.extend((f, n) for n in sf.keys())  # noqa: SIM118 - safe_open has no __iter__
    bar = tqdm(total=len(names), desc="Loading weights", unit="tensor", disable=not progress)
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118
                bar.update(1)
                if _IGNORED.search(name):
                    continue
                tensor = sf.get_tensor(name)
                m = _EXPERT.match(name)
                if transform is not None:
                    picked = transform(f"{m['prefix']}.{m['w']}" if m else name, tensor, m is not None)
                    if picked is None:
                        continue
                    tensor = picked[1]
                    if not m:
                        name = picked[0]
                if m:
                    target = f"{m['prefix']}.{m['w']}"
                    param = _param(params, target, name, f)
                    idx = int(m["idx"])
                    if idx >= param.shape[0]:
                        raise CheckpointError(f"{name}: expert {idx} >= num_experts {param.shape[0]}")
                    _check_shape(name, tuple(tensor.shape), tuple(param.shape[1:]))
                    param.data[idx].copy_(tensor)
                    expert_loaded.setdefault(target, set()).add(idx)
                else:
                    param = _param(params, name, name, f)
                    _check_shape(name, tuple(tensor.shape), tuple(param.shape))
                    param.data.copy_(tensor)
                    loaded.add(name)
    bar.close()
    missing = []
    for name, p in params.items():
        if name in loaded:
            continue
        if name in expert_loaded:
            absent = sorted(set(range(p.shape[0])) - expert_loaded[name])
            if absent:
                missing.append(f"{name} experts {absent[:8]}")
            continue
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        missing.append(f"{name} {tuple(p.shape)}")
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): " + "; ".join(missing[:10]))


def _param(params: dict[str, torch.nn.Parameter], target: str, name: str, f: Path) -> torch.nn.Parameter:
    if target not in params:
        raise CheckpointError(f"unexpected tensor {name!r} in {f.name}: the model has no such parameter")
    return params[target]


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise CheckpointError(f"tensor {name!r} has shape {list(got)} in the checkpoint, model expects {list(want)}")
