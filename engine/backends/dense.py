"""The dense projections of the models (``nn.Linear`` weights, no bias): ``F.linear`` as the reference; on CUDA the
skinny GEMM of kernels/gemv for one-row (batch-1 decode) steps, where cuBLAS's tiles leave a fifth to half of the copy
bandwidth unused (kernels/gemv/triton.py's docstring; ``bench/gemv_sweep.py``)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


class TorchDense:
    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ weight [N, K]^T."""
        return F.linear(x, weight)

    def gated_norm_linear(
        self, x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
    ) -> torch.Tensor | None:
        """KDA's output norm and projection in one launch where this backend fuses them (x, gate [T, H * D]);
        None means it does not: the caller runs the norm, then ``linear``."""
        return None

    def add_norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A pre-norm layer's input: (rms_norm(x + residual) @ weight^T, x + residual) in one launch where this
        backend fuses them (residual None: x is the whole input); None means it does not: the caller runs the
        norm, then ``linear``."""
        return None


DENSE_GEMV_MAX_ROWS = 1
"""Rows up to which the projections take the skinny GEMM. ``bench/gemv_sweep.py`` on the H200: at one row it beat
cuBLAS at every mid-model shape (7-27 %: the 19 MB o_proj 7.3 us against 10.0); at 4 and 16 rows it won the
input projections by ~7 % and lost the 42 MB down projection (19.2 against 15.8 us), so those stay on cuBLAS."""


class TritonDense(TorchDense):
    """kernels/gemv for 2-D x of 1..``max_rows`` rows on CUDA (and on the host under TRITON_INTERPRET=1);
    everything else, longer steps included, through ``F.linear``."""

    def __init__(self, max_rows: int = DENSE_GEMV_MAX_ROWS, add_norm: bool = False) -> None:
        from kernels.gemv.add_norm import add_norm_gemv, add_norm_gemv_fits
        from kernels.gemv.gated_norm import gated_norm_gemv, gated_norm_gemv_fits
        from kernels.gemv.triton import GEMV_MAX_ROWS, gemv
        from kernels.triton_utils import is_interpreting

        if not 0 <= max_rows <= GEMV_MAX_ROWS:
            raise ValueError(f"max_rows must be in 0..{GEMV_MAX_ROWS}, got {max_rows}")
        self.max_rows = max_rows
        self.add_norm = add_norm
        self._gemv = gemv
        self._gated_norm_gemv, self._gated_fits = gated_norm_gemv, gated_norm_gemv_fits
        self._add_norm_gemv, self._add_norm_fits = add_norm_gemv, add_norm_gemv_fits
        self._is_interpreting = is_interpreting

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        fits = x.ndim == 2 and 0 < x.shape[0] <= self.max_rows and x.dtype == weight.dtype
        if fits and x.stride(1) == 1 and weight.stride(1) == 1 and (x.is_cuda or self._is_interpreting()):
            return self._gemv(x, weight)
        return F.linear(x, weight)

    def gated_norm_linear(
        self, x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
    ) -> torch.Tensor | None:
        """One-row steps (``max_rows`` >= 1): kernels/gemv/gated_norm.py, the norm inside the GEMV's loads."""
        if self.max_rows < 1 or not (x.is_cuda or self._is_interpreting()):
            return None
        if not self._gated_fits(x, gate, weight, norm_weight.numel()):
            return None
        return self._gated_norm_gemv(x, gate, norm_weight, eps, weight)

    def add_norm_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One-row steps (``max_rows`` >= 1): kernels/gemv/add_norm.py, the norm inside the GEMV's loads."""
        if not self.add_norm or self.max_rows < 1 or not (x.is_cuda or self._is_interpreting()):
            return None
        if not self._add_norm_fits(x, residual, weight) or norm_weight.shape != (x.shape[-1],):
            return None
        return self._add_norm_gemv(x, residual, norm_weight, eps, weight)


def gpu_dense_backend() -> TorchDense:
    """``TANDEM_GEMV``: ``1`` (default) the skinny GEMM for one-row steps, ``0`` cuBLAS for every projection.
    ``TANDEM_GEMV_ADD_NORM``: ``1`` each layer's input norm inside its first projection at one row, ``0`` (default)
    the norm's own launch: on the H200 the fused form made a b1 step ~24 us slower (966 -> 990 us at 4k; every
    program re-reads the whole row for its sum of squares), docs/PERFORMANCE.md, twenty-eighth session."""
    choice = os.environ.get("TANDEM_GEMV", "1").strip()
    add_norm = os.environ.get("TANDEM_GEMV_ADD_NORM", "0").strip()
    for name, value in (("TANDEM_GEMV", choice), ("TANDEM_GEMV_ADD_NORM", add_norm)):
        if value not in ("0", "1"):
            raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return TritonDense(add_norm=add_norm == "1") if choice == "1" else TorchDense()


__all__ = ["DENSE_GEMV_MAX_ROWS", "TorchDense", "TritonDense", "gpu_dense_backend"]
