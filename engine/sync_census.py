"""Where the host waits for the GPU: torch's sync debug mode, each synchronising call counted by the
innermost frames of our own code that led to it.

Used by ``bench/sync_points.py`` (single process) and by the parallel ranks' step profiler
(``TANDEM_SYNC_CENSUS=1`` with ``TANDEM_PROFILE_DIR``). A sync in the middle of a forward drains the GPU's
queue: the GPU idles while the host enqueues the next kernels.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator

import torch

OURS = ("/engine/", "/kernels/")


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-3] if any(o in f.filename for o in OURS)]
    return " <- ".join(f"{f.filename.split('/')[-2]}/{f.filename.split('/')[-1]}:{f.lineno}" for f in frames[::-1][:3])


@contextlib.contextmanager
def sync_census() -> Iterator[Counter]:
    """Counts every synchronising CUDA call (device-to-host copy, ``.item()``, ``.tolist()``, a blocking
    host-to-device copy, ``nonzero``) made inside the block, by where our code made it."""
    seen: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        seen[_where() or f"{filename}:{lineno}"] += 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning and the filters on exit
            warnings.simplefilter("always")
            warnings.showwarning = record
            yield seen
    finally:
        torch.cuda.set_sync_debug_mode("default")
