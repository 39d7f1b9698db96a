"""Opt-in torch.profiler tables of a rank's big steps, to see where a parallel step's time goes on a GPU.

    TANDEM_PROFILE_DIR=/tmp/prof [TANDEM_PROFILE_MIN_TOKENS=8192] [TANDEM_PROFILE_STEPS=4] python -m bench...

Each rank writes ``rank{r}-step{n}-{tokens}.txt``: ops by device time and by host time. Off (no cost) unless
the directory is set. With ``TANDEM_SYNC_CENSUS=1`` the same steps instead count where the host waited for
the GPU (``engine/sync_census.py``): ``rank{r}-step{n}-{tokens}-syncs.txt``. With ``TANDEM_PROFILE_TRACE=1``
the profiled steps' traces are kept too (``...-trace.json.gz``; ``python -m bench.mid.gaps`` lists where the
GPU waited).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.sync_census import sync_census
from kernels.env import env_switch


class StepProfiler:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        where = os.environ.get("TANDEM_PROFILE_DIR", "")
        self.dir = Path(where) if where else None
        self.min_tokens = int(os.environ.get("TANDEM_PROFILE_MIN_TOKENS", "8192"))
        self.left = int(os.environ.get("TANDEM_PROFILE_STEPS", "4"))
        self.skip = int(os.environ.get("TANDEM_PROFILE_SKIP", "0"))  # big steps to pass over first (warm-up)
        self.count = 0
        self.syncs = env_switch("TANDEM_SYNC_CENSUS", False)
        self.trace = env_switch("TANDEM_PROFILE_TRACE", False)

    @contextlib.contextmanager
    def step(self, num_tokens: int) -> Iterator[None]:
        if self.dir is None or self.left <= 0 or num_tokens < self.min_tokens:
            yield
            return
        if self.skip > 0:
            self.skip -= 1
            yield
            return
        self.left -= 1
        self.count += 1
        if _profiler_running():  # counted, so every rank's n-th profiled step is the same step
            yield
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}-step{self.count}-{num_tokens}"
        if self.syncs:
            with sync_census() as seen:
                yield
            lines = [f"{sum(seen.values())} synchronising calls"] + [f"{n:5d}  {w}" for w, n in seen.most_common()]
            (self.dir / f"{name}-syncs.txt").write_text("\n".join(lines) + "\n")
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            yield
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        avg = prof.key_averages()
        by_device = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        text = avg.table(sort_by=by_device, row_limit=35) + "\n\n" + avg.table(sort_by="cpu_time_total", row_limit=35)
        (self.dir / f"{name}.txt").write_text(text)
        if self.trace:
            prof.export_chrome_trace(str(self.dir / f"{name}-trace.json.gz"))


def _profiler_running() -> bool:
    """A profiler around the whole step is already on (a benchmark's trace on rank 0): kineto does not nest."""
    return bool(torch.autograd.profiler._is_profiler_enabled)
