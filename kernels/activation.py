"""SiLU(gate) * up: the activation of every SwiGLU MLP here (dense, shared experts, routed experts).

With packed weights the gate and up halves are two strided views of one GEMM output; torch runs SiLU and the
multiply as two non-vectorised kernels over them and writes an intermediate in between. On CUDA this takes
fla-core's ``swiglu_fwd`` instead: one kernel that reads both halves in place, computes in fp32 and rounds
once. Elsewhere (the CPU reference path) it is exactly ``F.silu(gate) * up``. fla is imported on the first
CUDA call only (the CPU engine and the HF-parity tests never import it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F


@functools.cache
def _swiglu() -> Callable | None:
    try:
        from fla.modules.activations.ops import swiglu_fwd
    except ImportError:
        return None
    return swiglu_fwd


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.is_cuda and (fn := _swiglu()) is not None:
        return fn(gate, up)
    return F.silu(gate) * up


__all__ = ["silu_mul"]
