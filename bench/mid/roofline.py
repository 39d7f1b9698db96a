"""The device's measured ceilings, taken in the benchmark's own process: bf16 matmul peak and copy bandwidth."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def timed_best(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 2) -> float:
    """Best-of-`iters` seconds of fn() (CUDA events on the GPU, perf_counter on the host)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def matmul_peak_flops(device: torch.device, n: int | None = None, iters: int = 10) -> dict[str, float]:
    """Dense bf16 (fp32 on the host) n x n x n matmul: the best achieved FLOP/s."""
    cuda = device.type == "cuda"
    n = n or (8192 if cuda else 512)
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    t = timed_best(lambda: torch.mm(a, b, out=out), device, iters)
    return {"n": n, "dtype": str(dtype), "seconds": t, "flops_per_s": 2.0 * n**3 / t}


def copy_bandwidth(device: torch.device, nbytes: int | None = None, iters: int = 10) -> dict[str, float]:
    """Device-to-device copy of nbytes: bytes read + written per second."""
    nbytes = nbytes or ((4 << 30) if device.type == "cuda" else (64 << 20))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = timed_best(lambda: dst.copy_(src), device, iters)
    return {"bytes": nbytes, "seconds": t, "bytes_per_s": 2.0 * nbytes / t}
