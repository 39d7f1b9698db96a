"""Small helpers shared by the Triton kernels in ``kernels/<op>/triton.py``.

Importing this module imports triton; the CPU reference engine never does (only the GPU backend and
``tests/kernels`` import the Triton modules).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

INT32_MAX = 2**31 - 1


def is_interpreting() -> bool:
    """True when kernels run under ``TRITON_INTERPRET=1`` (numpy on the CPU)."""
    return bool(triton.knobs.runtime.interpret)


def next_pow2(n: int) -> int:
    return int(triton.next_power_of_2(max(int(n), 1)))


def dot_config(dtype: torch.dtype) -> tuple[bool, str]:
    """(DOT_F32, PREC) constexprs for ``tl.dot`` on inputs of ``dtype``.

    - fp32 inputs use ``ieee`` precision, so the fp32 tests compare against the reference to ~1e-6
      instead of TF32's ~1e-3.
    - Under the interpreter (triton 3.9), ``tl.dot`` on bf16/fp16 operands returns garbage (~1e10), so
      operands are upcast to fp32 first. On a GPU bf16 stays bf16 (tensor cores, fp32 accumulate).
    """
    if is_interpreting():
        return True, "ieee"
    return False, "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def mm(a, b, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """``tl.dot`` with the (DOT_F32, PREC) of ``dot_config``: operands upcast to fp32 first when DOT_F32."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    return tl.dot(a, b, input_precision=PREC)


def check_device(name: str, *tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    for t in tensors[1:]:
        if t.device != dev:
            raise ValueError(f"{name}: all tensors must be on one device, got {dev} and {t.device}")
    if dev.type != "cuda" and not is_interpreting():
        raise ValueError(f"{name}: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 on CPU), got {dev}")


def as_index_tensor(x: Sequence[int] | torch.Tensor, device: torch.device, name: str) -> torch.Tensor:
    """A 1-D int32 tensor on ``device`` from a list or tensor (no copy if already right)."""
    if isinstance(x, torch.Tensor):
        if x.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
        return x.to(device=device, dtype=torch.int32)
    return torch.tensor(list(x), dtype=torch.int32, device=device)


class LaunchTicket:
    """The ticket of a launch whose last program finishes the work (kernels/moe/route_fused.py,
    kernels/gemv/norm_after.py): one zeroed int32 per device, made outside any CUDA graph capture (a tensor made
    inside one would be zeroed by a memset node on every replay) and reused by every launch on that device; each
    launch puts it back to 0. ``size``: counters a launch needs (kernels/moe/route_gate_up.py takes SYNC_SIZE)."""

    def __init__(self, size: int = 1) -> None:
        self._size = size
        self._tickets: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        t = self._tickets.get(device)
        if t is None:
            t = self._tickets[device] = torch.zeros(self._size, dtype=torch.int32, device=device)
        return t
