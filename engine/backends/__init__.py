"""Pluggable compute backends for attention, KDA and MoE.

Model code calls these interfaces only; the reference (PyTorch, any device) implementation
defines the contract and the GPU path drops in faster ones without touching the models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.backends.base import AttentionBackend, KDABackend, MoEBackend
from engine.backends.torch_ref import TorchAttentionBackend, TorchKDABackend, TorchMoEBackend


@dataclass(frozen=True)
class Backends:
    attention: AttentionBackend
    kda: KDABackend
    moe: MoEBackend


def select_backends(device: torch.device) -> Backends:
    # Only the reference path exists so far; the GPU issue registers kernels here per device type.
    return Backends(TorchAttentionBackend(), TorchKDABackend(), TorchMoEBackend())


__all__ = ["AttentionBackend", "Backends", "KDABackend", "MoEBackend", "select_backends"]
