"""Weight prefetch into L2 ahead of the projection that reads it (kernels/prefetch/triton.py).

The models name the weight a layer is about to stream right before a stretch of latency-bound launches — KDA's
o_proj after its input projection (the short conv and the recurrence run in between), MLA's o_proj after q | kv_a
(the attention's split and combine), the shared expert after the attention (the norm and the routing) — and call
``join`` right before the launch that reads it. A prefetch is a hint: outputs are the same with or without it.

The prefetch launch runs on a side stream, forked from the step's stream at ``weights`` and joined back at
``join``: its programs retire only once the copy unit has taken their requests (4.2-4.5 us for 19 MB on the H100,
``bench/l2_prefetch.py``), and in the step's stream that time would sit on the critical path, which cost more
than the reader saves. Forked, it overlaps the window's launches; inside a CUDA graph the fork and the join are
two edges of the graph.
"""

from __future__ import annotations

import os

import torch


class NoPrefetch:
    """The reference: nothing is asked (always correct: a prefetch changes no value)."""

    max_rows = 0

    def weights(self, rows: int, *tensors: torch.Tensor) -> None:
        """Ask for ``tensors`` (1-2 contiguous weights) to be pulled into L2 at a step of ``rows`` rows."""

    def join(self) -> None:
        """Before the launch that reads the weights asked for: the step's stream waits for the prefetch."""


class L2Prefetch(NoPrefetch):
    """Steps of at most ``max_rows`` rows on CUDA: one prefetch launch a call, on a side stream. At a few rows a
    step's windows between weight streams leave HBM idle; at larger batches the attention reads the KV cache in
    them, and a prefetch would compete with it, so longer steps ask nothing."""

    def __init__(self, max_rows: int = 1) -> None:
        from kernels.prefetch.triton import l2_prefetch

        if max_rows < 1:
            raise ValueError(f"L2Prefetch needs max_rows >= 1 (NoPrefetch asks nothing), got {max_rows}")
        self.max_rows = max_rows
        self._prefetch = l2_prefetch
        self._sides: dict[torch.device, torch.cuda.Stream] = {}
        self._pending: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None  # (step stream, side stream)

    def weights(self, rows: int, *tensors: torch.Tensor) -> None:
        if rows > self.max_rows or not tensors[0].is_cuda:
            return
        # a range the instruction cannot take (a strided view, an odd offset) is simply not asked: it is a hint
        usable = [t for t in tensors if t.is_contiguous() and t.data_ptr() % 16 == 0]
        if not usable:
            return
        self.join()  # at most one fork open
        dev = usable[0].device
        side = self._sides.get(dev)
        if side is None:
            side = self._sides[dev] = torch.cuda.Stream(device=dev)
        step = torch.cuda.current_stream(dev)
        side.wait_stream(step)  # the fork: after everything the step launched so far
        with torch.cuda.stream(side):
            self._prefetch(*usable)
        self._pending = (step, side)

    def join(self) -> None:
        if self._pending is not None:
            step, side = self._pending
            step.wait_stream(side)
            self._pending = None


def gpu_prefetch_backend() -> NoPrefetch:
    """``TANDEM_L2_PREFETCH_ROWS``: steps of at most this many rows prefetch their next weights, 0 (default) none."""
    raw = os.environ.get("TANDEM_L2_PREFETCH_ROWS", "0").strip() or "0"
    if not raw.isdigit():
        raise ValueError(f"TANDEM_L2_PREFETCH_ROWS must be a row count >= 0, got {raw!r}")
    return L2Prefetch(int(raw)) if int(raw) else NoPrefetch()


__all__ = ["L2Prefetch", "NoPrefetch", "gpu_prefetch_backend"]
