"""Host-to-device copies that do not make the host wait for the GPU.

A plain ``.to(cuda)`` of pageable memory synchronises the stream; in the middle of a forward that drains
the GPU's queue, and the GPU idles while the host enqueues the next kernels. Copying from pinned memory
with ``non_blocking`` does not wait (torch keeps the pinned block until the copy has run).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; from a host tensor to CUDA through pinned memory, asynchronously."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if t.device == device:
        return t  # the host engine: nothing to move (the common case on the CPU, called per request)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return pinned_copy(t).to(device, non_blocking=True)


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into a block of the pinned host cache. Not ``t.pin_memory()``: that first asks the driver
    whether t is pinned already, which took ~2.8 ms of a step's first upload on the H200's host (the trace of
    bench/prefill_host.py); freed blocks are reused once their copies have run."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return host


Upload = Callable[[torch.Tensor, "torch.device | str"], torch.Tensor]
"""``upload``'s signature: step builders take one, so a CUDA graph's metadata can go to fixed buffers."""


class StaticUploads:
    """``upload`` into device buffers that keep their addresses from step to step: the n-th upload after
    ``rewind`` lands in the n-th buffer. A CUDA graph captured over a step's metadata reads these buffers; a
    later step with the same layout (the same uploads, in the same order and shapes) refills them before the
    replay. A different sequence of uploads raises (the caller stops replaying that graph)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._next = 0

    def rewind(self) -> None:
        self._next = 0

    def __call__(self, t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        device = torch.device(device) if not isinstance(device, torch.device) else device
        i, self._next = self._next, self._next + 1
        if i == len(self._buffers):
            self._buffers.append(torch.empty(t.shape, dtype=t.dtype, device=device))
        buf = self._buffers[i]
        if buf.shape != t.shape or buf.dtype != t.dtype or buf.device.type != device.type:
            have = f"{tuple(buf.shape)} {buf.dtype} on {buf.device.type}"
            raise ValueError(f"static upload {i}: {tuple(t.shape)} {t.dtype} on {device.type}, the buffer is {have}")
        if buf.is_cuda and t.device.type == "cpu":
            buf.copy_(pinned_copy(t), non_blocking=True)  # ordered before the replay on the same stream
        else:
            buf.copy_(t)
        return buf


class PinnedStaging:
    """A step's int64 host arrays uploaded in one copy, through pinned host buffers allocated once.

    Two buffers, used in turn; a buffer is refilled only after its last copy has run (its event), which the
    step between has long waited for. No allocation and no driver query per step: on the H200's host the
    step's first pinned allocation took ~2.7 ms before the first kernel could start (bench/prefill_host.py);
    one copy instead of one per request also spares an eager decode step ~60 small uploads. Not thread-safe:
    one owner (the model runner)."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = device
        self._capacity = 0
        self._buffers: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        if device.type == "cuda":
            self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        for ev in self._events:
            if ev is not None:
                ev.synchronize()
        self._capacity = capacity
        self._buffers = [torch.empty(capacity, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._events = [None, None]

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Each 1-D int64 array as a tensor on the device (views of one device copy); on the host, as is."""
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays]
        total = sum(len(a) for a in arrays)
        if total > self._capacity:
            self._grow(max(total, 2 * self._capacity))
        i, self._turn = self._turn, self._turn ^ 1
        if self._events[i] is not None:
            self._events[i].synchronize()  # its copy ran a step ago: returns at once
        host = self._buffers[i]
        view = host.numpy()
        bounds = [0]
        for a in arrays:
            view[bounds[-1] : bounds[-1] + len(a)] = a
            bounds.append(bounds[-1] + len(a))
        dev = host[:total].to(self.device, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._events[i] = ev
        return [dev[a:b] for a, b in itertools.pairwise(bounds)]
