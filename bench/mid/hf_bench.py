"""The same workloads through HF transformers (``AutoModelForCausalLM``: KimiLinearForCausalLM / Qwen3) on the
same device, as transformers ships it (fla kernels when importable, its default experts implementation).

Decode caches are filled like Tandem's: one prompt is prefilled, then every batch-leading tensor of the cache
is repeated B times (``repeat_cache``); where that fails the batch is prefilled whole. Every workload reports
an error string instead of raising (OOM, unsupported paths), so the run always completes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.mid.tandem_bench import sync


def load_hf(model_dir: str, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    if device.type == "cuda":
        try:  # straight onto the GPU: a host copy of the expert weights first costs ~a minute
            return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=str(device)).eval()
        except (ImportError, ValueError, TypeError):
            pass
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def guarded(fn: Callable[[], dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """fn()'s result, or {'error': ...} when it fails (an OOM included); frees cached memory either way."""
    try:
        return fn()
    except Exception as err:
        kind = "OOM" if isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err) else "error"
        return {"error": f"{kind}: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


@torch.inference_mode()
def hf_prefill(model: Any, ids: list[int], repeat: int, device: torch.device) -> dict[str, Any]:
    x = torch.tensor([ids], device=device)
    times = []
    for i in range(repeat + 1):
        sync(device)
        t0 = time.perf_counter()
        model(x, use_cache=False, logits_to_keep=1)
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"seconds": t, "tokens_per_s": len(ids) / t}


def _rep(value: Any, batch: int, count: list[int]) -> Any:
    """value with every batch-leading tensor (dim >= 2, leading dim 1) repeated B times, in lists / dicts too."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 2 and value.shape[0] == 1:
            count[0] += 1
            return value.repeat_interleave(batch, 0)
        return value
    if isinstance(value, dict):
        return {k: _rep(v, batch, count) for k, v in value.items()}
    if isinstance(value, list | tuple):
        new = [_rep(v, batch, count) for v in value]
        return tuple(new) if isinstance(value, tuple) else new
    return value


def repeat_cache(cache: Any, batch: int) -> int:
    """Repeat the cache's batch-leading tensors (every layer's attributes) B times; returns how many."""
    count = [0]
    for layer in getattr(cache, "layers", None) or [cache]:
        for name, value in list(vars(layer).items()):
            setattr(layer, name, _rep(value, batch, count))
    return count[0]


@torch.inference_mode()
def hf_decode(model: Any, ids: list[int], batch: int, steps: int, device: torch.device) -> dict[str, Any]:
    """Mean step time of greedy decode of `batch` sequences at context len(ids)."""
    x = torch.tensor([ids], device=device)
    out = model(x, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1).expand(batch).reshape(batch, 1).contiguous()
    cache = out.past_key_values
    if batch == 1:
        return {"step_seconds": _steps(model, cache, nxt, steps, device), "cache_fill": "prefill"}
    try:
        if repeat_cache(cache, batch) == 0:
            raise RuntimeError("no batch-leading tensors in the cache")
        return {"step_seconds": _steps(model, cache, nxt, steps, device), "cache_fill": "prefill 1 + repeated cache"}
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception:
        del cache
        out = model(x.expand(batch, -1).contiguous(), use_cache=True, logits_to_keep=1)
        t = _steps(model, out.past_key_values, nxt, steps, device)
        return {"step_seconds": t, "cache_fill": "prefill of the whole batch"}


def _steps(model: Any, cache: Any, nxt: torch.Tensor, steps: int, device: torch.device) -> float:
    times = []
    for _ in range(steps + 2):
        sync(device)
        t0 = time.perf_counter()
        out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        times.append(time.perf_counter() - t0)
        cache = out.past_key_values
    if not torch.isfinite(out.logits).all():
        raise RuntimeError("non-finite logits in HF decode")
    return statistics.mean(times[2:])


def block_fla() -> None:
    """Host runs: make transformers take its pure-torch Kimi-Linear path (fla's Triton kernels need a GPU)."""
    import importlib.abc
    import sys

    class _BlockFla(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: object = None, target: object = None) -> None:
            if name == "fla" or name.startswith("fla."):
                raise ModuleNotFoundError(f"No module named {name!r} (blocked: host run)", name=name)

    if not any(type(f).__name__ == "_BlockFla" for f in sys.meta_path):
        sys.meta_path.insert(0, _BlockFla())
