"""Where a step's time goes: torch.profiler over labelled ranges, grouped into attention / KDA / MoE / GEMM / other.

The backends' methods (attention: write_kv, gqa, mla; KDA: short_conv, recurrence; MoE: route, experts) and
every nn.Linear or packed projection outside the MoE block (projections, dense MLP, LM head) run inside a
``tandem.<group>`` record_function range while profiling. On the GPU a group's time is the summed time of the
kernels that ran inside the range's GPU-side span (innermost range wins), "total" the time of every kernel, so
Triton launches (which have no aten op to hang their time on) count too; "other" is the remainder: norms, the
KDA gate, embedding, residual adds, sampling. The shared expert's linears count as MoE. On the host (no GPU) the same
grouping uses CPU time, which only checks the plumbing.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from engine.models.layers import PackedProjection

GROUPS = ("attention", "KDA", "MoE", "GEMM")
PREFIX = "tandem."
_METHODS = {
    "attention": ("write_kv", "gqa", "mla"),
    "KDA": ("short_conv", "short_conv_qkv", "gated_conv_recurrence", "conv_recurrence", "recurrence"),
    "MoE": ("route_hidden", "router_logits", "route", "experts"),  # the fused route calls neither inner one
    "GEMM": ("linear",),
}


def _wrap(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    def labelled(*a: Any, **k: Any) -> Any:
        with record_function(label):
            return fn(*a, **k)

    return labelled


@contextmanager
def labelled_ops(model: nn.Module) -> Iterator[None]:
    be = model.backends
    patched = []
    for group, obj in (("attention", be.attention), ("KDA", be.kda), ("MoE", be.moe), ("GEMM", be.dense)):
        for name in _METHODS[group]:
            setattr(obj, name, _wrap(getattr(obj, name), PREFIX + group))
            patched.append((obj, name))
    handles = []
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, PackedProjection)) and "block_sparse_moe" not in mod_name:
            handles.append(mod.register_forward_pre_hook(_enter_gemm))
            handles.append(mod.register_forward_hook(_exit_gemm))
    try:
        yield
    finally:
        for obj, name in patched:
            delattr(obj, name)  # the instance attribute shadowed the class method
        for h in handles:
            h.remove()


def _enter_gemm(mod: nn.Module, args: Any) -> None:
    mod._tandem_rf = record_function(PREFIX + "GEMM")
    mod._tandem_rf.__enter__()


def _exit_gemm(mod: nn.Module, args: Any, out: Any) -> None:
    mod._tandem_rf.__exit__(None, None, None)


def profiled(fn: Callable[[], Any], device: torch.device, stacks: bool = False) -> profile:
    """stacks: record each op's Python stack (for ``copy_sites``; costs host time, not GPU time)."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, with_stack=stacks) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return prof


def _get(e: Any, *names: str) -> float:
    for n in names:
        if hasattr(e, n):
            return float(getattr(e, n))
    return 0.0


def _gpu_spans(prof: profile) -> tuple[list[tuple[float, float, str]], list[tuple[float, float]]]:
    """(GPU-side spans of the tandem.* ranges, sorted by start; every kernel / memcpy / memset interval)."""
    spans, kernels = [], []
    for e in prof.events():
        if getattr(e, "device_type", DeviceType.CPU) == DeviceType.CPU:
            continue
        tr = e.time_range
        if e.name.startswith(PREFIX):
            if e.name[len(PREFIX) :] in GROUPS:
                spans.append((float(tr.start), float(tr.end), e.name[len(PREFIX) :]))
        else:
            kernels.append((float(tr.start), float(tr.end)))
    spans.sort()
    return spans, kernels


def _breakdown_by_spans(prof: profile, per: int) -> dict[str, float] | None:
    spans, kernels = _gpu_spans(prof)
    if not spans:
        return None
    starts = [s[0] for s in spans]
    out, total = dict.fromkeys(GROUPS, 0.0), 0.0
    for ks, ke in kernels:
        total += ke - ks
        j = bisect.bisect_right(starts, ks) - 1
        for i in range(j, max(j - 64, -1), -1):  # the latest-starting span that contains it is the innermost
            if spans[i][1] >= ke:
                out[spans[i][2]] += ke - ks
                break
    res = {k: v / 1e3 / per for k, v in out.items()}
    res["total"] = total / 1e3 / per
    res["other"] = res["total"] - sum(res[g] for g in GROUPS)
    return res


def breakdown(prof: profile, device: torch.device, per: int = 1) -> dict[str, float]:
    """Milliseconds per group (divided by `per`, e.g. the number of steps profiled), 'other' and 'total'."""
    cuda = device.type == "cuda"
    if cuda and (by_spans := _breakdown_by_spans(prof, per)) is not None:
        return by_spans
    incl = ("device_time_total", "cuda_time_total") if cuda else ("cpu_time_total",)
    self_ = ("self_device_time_total", "self_cuda_time_total") if cuda else ("self_cpu_time_total",)
    out = dict.fromkeys(GROUPS, 0.0)
    total = 0.0
    for e in prof.events():
        if getattr(e, "device_type", DeviceType.CPU) != DeviceType.CPU:
            continue  # kernels and GPU-side annotations: counted through their CPU op
        total += _get(e, *self_)
        if e.name.startswith(PREFIX) and e.name[len(PREFIX) :] in out:
            out[e.name[len(PREFIX) :]] += _get(e, *incl)
    res = {k: v / 1e3 / per for k, v in out.items()}
    res["total"] = total / 1e3 / per
    res["other"] = res["total"] - sum(res[g] for g in GROUPS)
    return res


def top_kernels(prof: profile, device: torch.device, rows: int = 15) -> str:
    """torch's table of the most expensive ops / kernels (raw data behind the grouping)."""
    keys = ("self_cuda_time_total", "self_device_time_total") if device.type == "cuda" else ("self_cpu_time_total",)
    for key in keys:
        try:
            return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
        except Exception:
            continue
    return ""


def kernel_census(prof: profile, per: int = 1, rows: int = 25) -> dict[str, Any]:
    """How many GPU kernels a step launches and which ops launch them: in a CUDA graph every one is a node
    with its own launch gap, so the count (not only the kernels' time) sets the step's floor."""
    from collections import Counter

    kernels, kernel_us, by_op = Counter(), Counter(), Counter()
    for e in prof.events():
        dev = getattr(e, "device_type", DeviceType.CPU)
        if dev == DeviceType.CPU:
            n = len(getattr(e, "kernels", []) or [])
            if n and not e.name.startswith(PREFIX):
                by_op[e.name] += n
        elif not e.name.startswith(PREFIX):
            kernels[e.name[:90]] += 1
            kernel_us[e.name[:90]] += _get(e, "device_time_total", "cuda_time_total")
    return {
        "kernels_per_step": sum(kernels.values()) / per,
        "kernel_us_per_step": sum(kernel_us.values()) / per,
        "by_kernel": [(k, c / per, kernel_us[k] / per) for k, c in kernels.most_common(rows)],
        "by_op": [(k, c / per) for k, c in by_op.most_common(rows)],
    }


COPY_OPS = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::cat")
_OWN_CODE = ("engine/", "kernels/", "fla/", "bench/")


def _own_frames(e: Any) -> list[str]:
    """The project's / fla's frames above an op, innermost first. torch records the Python stack as enclosing
    "python_function" events named ``path(line): func`` (an op's own ``stack`` is empty in torch 2.11-2.13), so
    walk the op's parents; an explicit ``stack`` (older torch) is read too."""
    frames: list[str] = []
    while e is not None:
        names = list(getattr(e, "stack", []) or []) or [str(getattr(e, "name", ""))]
        frames += [f for f in names if "): " in f and any(o in f for o in _OWN_CODE)]
        e = getattr(e, "cpu_parent", None)
    return frames


def copy_sites(prof: profile, per: int = 1, rows: int = 20, depth: int = 3) -> list[tuple[str, float, float]]:
    """Where a step's copies come from: the innermost copy-like op of each launched kernel, grouped by the
    ``depth`` innermost frames of its Python stack that are the project's or fla's (profile with stacks=True).
    Rows: (frames, kernels per step, GPU us per step), most time first. Strided copies that a kernel could
    have read in place show up here by their call site."""
    from collections import Counter

    count, us = Counter(), Counter()
    for e in prof.events():
        if getattr(e, "device_type", DeviceType.CPU) != DeviceType.CPU or e.name not in COPY_OPS:
            continue
        kernels = getattr(e, "kernels", []) or []
        if not kernels:
            continue
        frames = _own_frames(e)[:depth]
        key = f"{e.name} <- " + " <- ".join(frames) if frames else e.name
        count[key] += len(kernels)
        us[key] += sum(float(getattr(k, "duration", 0.0)) for k in kernels)
    return [(k, count[k] / per, us[k] / per) for k, _ in us.most_common(rows)]
