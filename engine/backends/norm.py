"""RMSNorm in its three uses: plain, fused with the residual add before it, and gated (KDA's output norm).

``TorchNormBackend`` is the reference (HF numerics: normalise in fp32, cast, scale by the weight). On CUDA,
``FlaNormBackend`` runs fla-core's fused Triton norms: one kernel per norm instead of six or seven
elementwise launches, and the residual add folded into the following norm (vLLM's fused_add_rms_norm).
Inside a CUDA graph decode step every launch costs a graph node, so the count matters as much as the bytes.
"""

from __future__ import annotations

import torch

from kernels.env import env_switch


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class TorchNormBackend:
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return weight * _normalized(x, eps).to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x)."""
        h = residual + x
        return self.rms_norm(h, weight, eps), h

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """rms_norm(x) * w * sigmoid(gate), all in fp32, cast back to x's dtype."""
        return (weight.float() * _normalized(x, eps) * torch.sigmoid(gate.float())).to(x.dtype)

    def embed_rms_norm(
        self, embedding: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(rms_norm(embedding[ids]) * weight, embedding[ids])`` in one launch where the backend has one, else None:
        the model gathers the rows and runs the first layer's input norm itself."""
        return None


class FlaNormBackend(TorchNormBackend):
    """fla-core's fused norms (fla.modules.norm); CUDA tensors only, the reference otherwise.

    The RMS norms call fla's ``layer_norm_fwd`` (the forward under its ``rms_norm``) directly: same kernel,
    same arguments, without the autograd function and input guard (~19 calls a prefill step, which is
    host-bound at 8k tokens: bench/prefill_host.py)."""

    def __init__(self, embed_norm: bool = True) -> None:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        from fla.modules.norm.layernorm import layer_norm_fwd

        from kernels.embed_norm.triton import embed_rms_norm
        from kernels.triton_utils import is_interpreting

        self._layer_norm_fwd, self._rms_norm_gated = layer_norm_fwd, rms_norm_gated
        self.embed_norm, self._embed_rms_norm, self._is_interpreting = embed_norm, embed_rms_norm, is_interpreting

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not x.is_cuda:
            return super().rms_norm(x, weight, eps)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y, _, _, _ = self._layer_norm_fwd(rows, weight.contiguous(), None, eps=eps, is_rms_norm=True)
        return y.view(x.shape)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not x.is_cuda:
            return super().add_rms_norm(x, residual, weight, eps)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        res = residual.reshape(rows.shape).contiguous()
        y, _, _, res_out = self._layer_norm_fwd(
            rows, weight.contiguous(), None, eps=eps, residual=res, residual_dtype=res.dtype, is_rms_norm=True
        )
        return y.view(x.shape), res_out.view(x.shape)

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not x.is_cuda:
            return super().gated_rms_norm(x, gate, weight, eps)
        return self._rms_norm_gated(x, gate, weight, None, activation="sigmoid", eps=eps)

    def embed_rms_norm(
        self, embedding: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """kernels/embed_norm (``embed_norm``: ``TANDEM_EMBED_NORM``), on CUDA and under the interpreter."""
        if not self.embed_norm or not (ids.is_cuda or self._is_interpreting()):
            return None
        return self._embed_rms_norm(embedding, ids, weight, eps)


def gpu_norm_backend() -> TorchNormBackend:
    """fla's fused norms when fla-core imports, else the reference (the KDA backend warns about fla).
    ``TANDEM_EMBED_NORM``: ``1`` (default) the embedding's gather and the first input norm in one launch
    (kernels/embed_norm), ``0`` torch's gather, then fla's norm."""
    embed_norm = env_switch("TANDEM_EMBED_NORM", True)
    try:
        return FlaNormBackend(embed_norm=embed_norm)
    except ImportError:
        return TorchNormBackend()
