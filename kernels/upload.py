"""Host-to-device copies that do not make the host wait for the GPU.

A plain ``.to(cuda)`` of pageable memory synchronises the stream; in the middle of a forward that drains
the GPU's queue, and the GPU idles while the host enqueues the next kernels. Copying from pinned memory
with ``non_blocking`` does not wait (torch keeps the pinned block until the copy has run).
"""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; from a host tensor to CUDA through pinned memory, asynchronously."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if t.device == device:
        return t  # the host engine: nothing to move (the common case on the CPU, called per request)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
