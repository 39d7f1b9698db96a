"""Pluggable compute backends for attention, KDA, MoE and norms.

Model code calls these interfaces only; the reference (PyTorch, any device) implementation
defines the contract and the GPU path drops in faster ones without touching the models.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.backends.base import AttentionBackend, KDABackend, MoEBackend
from engine.backends.dense import TorchDense, TritonDense, gpu_dense_backend
from engine.backends.greedy import TorchGreedy, TritonGreedy
from engine.backends.norm import TorchNormBackend
from engine.backends.prefetch import NoPrefetch
from engine.backends.torch_ref import TorchAttentionBackend, TorchKDABackend, TorchMoEBackend


@dataclass(frozen=True)
class Backends:
    attention: AttentionBackend
    kda: KDABackend
    moe: MoEBackend
    norm: TorchNormBackend = field(default_factory=TorchNormBackend)
    greedy: TorchGreedy = field(default_factory=TorchGreedy)
    dense: TorchDense = field(default_factory=TorchDense)
    l2: NoPrefetch = field(default_factory=NoPrefetch)


def select_backends(device: torch.device) -> Backends:
    """The fast GPU backends (engine/backends/gpu.py, gpu_kda.py) on CUDA, the PyTorch reference elsewhere.

    ``TANDEM_BACKEND`` overrides: ``auto`` (default), ``torch`` (the reference everywhere, e.g. to bisect
    a GPU mismatch), ``gpu`` (insist on the GPU path: an error off CUDA), ``interpret`` (the GPU backends'
    code on the CPU under ``TRITON_INTERPRET=1``, KDA chunks by the reference chunk form instead of fla:
    tests of the GPU path's glue, e.g. under PCP, on a machine without a GPU; slow).
    """
    import os  # local: this function is the GPU issue's only edit in this module

    choice = os.environ.get("TANDEM_BACKEND", "auto").strip().lower() or "auto"
    if choice not in ("auto", "torch", "gpu", "interpret"):
        raise ValueError(f"TANDEM_BACKEND must be auto, torch, gpu or interpret, got {choice!r}")
    if choice == "gpu" and device.type != "cuda":
        raise ValueError(f"TANDEM_BACKEND=gpu needs a CUDA device, the engine runs on {device}")
    if choice == "interpret":
        if device.type != "cpu" or os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("TANDEM_BACKEND=interpret runs on the CPU with TRITON_INTERPRET=1 set before triton loads")
        from engine.backends.gpu import GPUAttentionBackend, GPUKDABackend, GPUMoEBackend
        from kernels.kda.naive import naive_chunk_kda_varlen

        kda = GPUKDABackend(chunk_fn=naive_chunk_kda_varlen)
        return Backends(GPUAttentionBackend(), kda, GPUMoEBackend(), greedy=TritonGreedy(), dense=TritonDense())
    if device.type == "cuda" and choice != "torch":
        from engine.backends.gpu import GPUAttentionBackend, GPUMoEBackend, gpu_kda_backend
        from engine.backends.norm import gpu_norm_backend
        from engine.backends.prefetch import gpu_prefetch_backend

        return Backends(
            GPUAttentionBackend(),
            gpu_kda_backend(),
            GPUMoEBackend(),
            gpu_norm_backend(),
            TritonGreedy(),
            gpu_dense_backend(),
            gpu_prefetch_backend(),
        )
    return Backends(TorchAttentionBackend(), TorchKDABackend(), TorchMoEBackend())


__all__ = ["AttentionBackend", "Backends", "KDABackend", "MoEBackend", "select_backends"]
