"""A step's per-row tensors (input ids, positions, KV slots), built without a Python loop per prefill token.

A 64k-token prefill chunk built token by token in Python, then ``torch.tensor(list)``, took ~60 ms of host
time before the GPU could start. Long chunks are built with tensor ops (``arange`` and a page-table gather);
short ones (decode: one token, spec verify: a few) keep Python lists, where a handful of tensor ops per
request would cost more. Parts are concatenated in chunk order.
"""

from __future__ import annotations

import numpy as np
import torch

LONG_CHUNK = 64
"""Chunks of at least this many tokens go through tensor ops."""


def int64_tensor(values: list[int] | np.ndarray) -> torch.Tensor:
    """``torch.tensor(values)``, ~3x faster for long lists (numpy converts Python ints in C)."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64))


class StepRows:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._ids: list[int] = []
        self._pos: list[int] = []
        self._slots: list[int] = []

    def add(
        self, ids: list[int] | np.ndarray, start: int, end: int, page_ids: list[int], pages: torch.Tensor, cached: int
    ) -> None:
        """Rows of tokens ``ids`` (a list, or int64 numpy for long chunks) at positions start..end-1; a
        position's KV slot is its page's row, or -1 below ``cached`` (KV already in the cache)."""
        ps = self.page_size
        if end - start < LONG_CHUNK:
            self._ids.extend(ids)
            self._pos.extend(range(start, end))
            self._slots.extend(page_ids[p // ps] * ps + p % ps if p >= cached else -1 for p in range(start, end))
            return
        self._flush()
        # numpy, not torch's CPU ops: on the H200's host torch's gather of an 8k-row page table took 2-4 ms
        # (bench/prefill_host.py trace), numpy's ~20 us; the GPU waits for this before the step's first kernel
        pos = np.arange(start, end, dtype=np.int64)
        slot = pages.numpy()[pos // ps] * ps + pos % ps
        if cached > start:
            slot[: cached - start] = -1
        self._parts.append((int64_tensor(ids), torch.from_numpy(pos), torch.from_numpy(slot)))

    def _flush(self) -> None:
        if self._ids:
            self._parts.append((int64_tensor(self._ids), int64_tensor(self._pos), int64_tensor(self._slots)))
            self._ids, self._pos, self._slots = [], [], []

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, positions, slot_mapping), each [T] int64 on the host."""
        self._flush()
        if not self._parts:
            empty = torch.zeros(0, dtype=torch.int64)
            return empty, empty.clone(), empty.clone()
        if len(self._parts) == 1:
            return self._parts[0]
        return tuple(torch.cat(col) for col in zip(*self._parts, strict=True))  # type: ignore[return-value]
