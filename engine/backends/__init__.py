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
    """The fast GPU backends (engine/backends/gpu.py) on CUDA, the PyTorch reference elsewhere.

    ``TANDEM_BACKEND`` overrides: ``auto`` (default), ``torch`` (the reference everywhere, e.g. to bisect
    a GPU mismatch), ``gpu`` (insist on the GPU path: an error off CUDA).
    """
    import os  # local: this function is the GPU issue's only edit in this module

    choice = os.environ.get("TANDEM_BACKEND", "auto").strip().lower() or "auto"
    if choice not in ("auto", "torch", "gpu"):
        raise ValueError(f"TANDEM_BACKEND must be auto, torch or gpu, got {choice!r}")
    if choice == "gpu" and device.type != "cuda":
        raise ValueError(f"TANDEM_BACKEND=gpu needs a CUDA device, the engine runs on {device}")
    if device.type == "cuda" and choice != "torch":
        from engine.backends.gpu import GPUAttentionBackend, GPUMoEBackend, gpu_kda_backend

        return Backends(GPUAttentionBackend(), gpu_kda_backend(), GPUMoEBackend())
    return Backends(TorchAttentionBackend(), TorchKDABackend(), TorchMoEBackend())


__all__ = ["AttentionBackend", "Backends", "KDABackend", "MoEBackend", "select_backends"]
