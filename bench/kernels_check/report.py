"""Reporting and timing helpers shared by the kernel-check sections (bench/gpu_kernels_check.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

GB = 1e9
TFLOP = 1e12


@dataclass
class Report:
    rows: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def check(
        self,
        name: str,
        ref: torch.Tensor | None,
        out: torch.Tensor | None,
        ms: float | None = None,
        nbytes: float | None = None,
        flops: float | None = None,
        rel_tol: float = 2e-2,
        exact: bool = False,
    ) -> None:
        err = ""
        ok = True
        if ref is not None and out is not None:
            r, o = ref.detach().float(), out.detach().float()
            if r.shape != o.shape:
                ok, err = False, f"shape {tuple(o.shape)} != {tuple(r.shape)}"
            else:
                d = (r - o).abs()
                max_abs = d.max().item() if d.numel() else 0.0
                scale = r.abs().max().item() if r.numel() else 0.0
                rms = (d.pow(2).sum().sqrt() / r.pow(2).sum().sqrt().clamp_min(1e-30)).item() if r.numel() else 0.0
                nan = bool(torch.isnan(o).any())
                ok = not nan and ((max_abs == 0.0) if exact else (rms < rel_tol))
                err = f"max_abs {max_abs:9.2e}  max_rel {max_abs / max(scale, 1e-30):9.2e}  rel_rms {rms:9.2e}"
                err += "  NaN!" if nan else ""
        perf = ""
        if ms is not None:
            perf = f"{ms * 1e3:9.1f} us"
            if nbytes:
                perf += f"  {nbytes / (ms * 1e-3) / GB:8.1f} GB/s"
            if flops:
                perf += f"  {flops / (ms * 1e-3) / TFLOP:8.1f} TFLOP/s"
        line = f"  {'ok ' if ok else 'BAD'} {name:<58} {err:<62} {perf}"
        print(line, flush=True)
        self.rows.append(line)
        if not ok:
            self.failures.append(name)

    def note(self, text: str) -> None:
        print(f"      {text}", flush=True)


def timed(fn: Callable[[], object], warmup: int = 2, iters: int = 10) -> float:
    """Mean milliseconds per call (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kernel_us_by_name(fn: Callable[[], object], iters: int = 20) -> dict[str, float]:
    """Microseconds of GPU time per call of each kernel, by name (torch.profiler)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    us: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            us[e.name] = us.get(e.name, 0.0) + e.device_time_total / iters
    return us


def kernel_ms(fn: Callable[[], object], iters: int = 20) -> float:
    """Milliseconds of GPU kernel time per call (torch.profiler): for kernels of a few microseconds, where
    back-to-back calls time the host's launches instead."""
    return sum(kernel_us_by_name(fn, iters).values()) / 1e3


def first_call(fn: Callable[[], object]) -> tuple[object, float]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


DEV = torch.device("cuda")
BF16 = torch.bfloat16


def _pages(ctx_lens: list[int], page_size: int, extra: int = 4, seed: int = 0):
    """Shuffled page ids per sequence and the pool size."""
    n_pages = [-(-c // page_size) for c in ctx_lens]
    total = sum(n_pages) + extra
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    tables, used = [], 0
    for n in n_pages:
        tables.append(perm[used : used + n].to(DEV))
        used += n
    return tables, total


def _qsl(q_lens: list[int]) -> list[int]:
    out = [0]
    for q in q_lens:
        out.append(out[-1] + q)
    return out
