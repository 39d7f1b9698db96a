"""Views of CUDA memory that do not keep it allocated (vLLM's weak_ref_tensor, from Python).

A piece's outputs live in the graph pool. Held by ordinary tensors they would stay reserved for good, and a
bucket's pieces would never reuse each other's memory (at 8k tokens the KDA cores' inputs alone are ~0.5 GB a
layer). Held weakly, the pool hands the memory to the next pieces; the replay order keeps it correct: a core
reads its inputs before the next piece overwrites them.
"""

from __future__ import annotations

import torch


class _CudaSpan:
    """``nbytes`` bytes at ``ptr``, as the CUDA array interface describes them (no owner)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


def weak_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor with t's device memory, shape and strides that does not own that memory."""
    if t.device.type != "cuda":
        return t  # no graph pool off CUDA (the host runs pieces eagerly): an ordinary reference
    if t.numel() == 0:
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    span = (sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()
    raw = torch.as_tensor(_CudaSpan(t.data_ptr(), span), device=t.device)
    return raw.view(t.dtype).as_strided(t.shape, t.stride())
