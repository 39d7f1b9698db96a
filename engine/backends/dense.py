"""The dense projections of the models (``nn.Linear`` weights, no bias): ``F.linear`` as the reference; on CUDA the
skinny GEMM of kernels/gemv for one-row (batch-1 decode) steps, where cuBLAS's tiles leave a fifth to half of the copy
bandwidth unused (kernels/gemv/triton.py's docstring; ``bench/gemv_sweep.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels.env import env_switch

if TYPE_CHECKING:
    from engine.backends.base import AddNorm


class TorchDense:
    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ weight [N, K]^T."""
        return F.linear(x, weight)

    def runs_gemv(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether ``linear(x, weight)`` runs kernels/gemv's skinny GEMM (whose one-row body another launch may
        run instead, with the same bits: kernels/short_conv/in_proj_conv.py)."""
        return False

    def gated_norm_linear(
        self,
        x: torch.Tensor,
        gate: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        norm_after: AddNorm | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """KDA's output norm and projection in one launch where this backend fuses them (x, gate [T, H * D]);
        with ``norm_after`` the norm after the projection too (its pair returned: ``linear_norm_after``). None means
        it does not: the caller runs the norm, then ``linear`` (or ``linear_norm_after``)."""
        return None

    def fuses_norm_after(self, rows: int) -> bool:
        """Whether ``linear_norm_after`` (and ``gated_norm_linear`` with ``norm_after``) may run the norm after a
        projection in its launch at steps of ``rows`` rows: a layer asks before it hands its attention the
        post-attention norm."""
        return False

    def linear_norm_after(
        self, x: torch.Tensor, weight: torch.Tensor, norm_after: AddNorm
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rms_norm(residual + x @ weight^T) * w, residual + x @ weight^T) in one launch where this backend fuses
        them; None means it does not: the caller runs ``linear``, then the norm."""
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

    def __init__(self, max_rows: int = DENSE_GEMV_MAX_ROWS, add_norm: bool = False, norm_after: bool = True) -> None:
        from kernels.gemv import gated_norm
        from kernels.gemv.add_norm import add_norm_gemv, add_norm_gemv_fits
        from kernels.gemv.norm_after import NormAfter
        from kernels.gemv.triton import GEMV_MAX_ROWS, gemv, gemv_norm_after
        from kernels.triton_utils import LaunchTicket, is_interpreting

        if not 0 <= max_rows <= GEMV_MAX_ROWS:
            raise ValueError(f"max_rows must be in 0..{GEMV_MAX_ROWS}, got {max_rows}")
        self.max_rows = max_rows
        self.add_norm = add_norm
        self.norm_after = norm_after
        self._gemv, self._gemv_norm_after = gemv, gemv_norm_after
        self._gated_norm_gemv, self._gated_fits = gated_norm.gated_norm_gemv, gated_norm.gated_norm_gemv_fits
        self._gated_norm_gemv_norm_after = gated_norm.gated_norm_gemv_norm_after
        self._norm_after_args, self._ticket = NormAfter, LaunchTicket()
        self._add_norm_gemv, self._add_norm_fits = add_norm_gemv, add_norm_gemv_fits
        self._is_interpreting = is_interpreting

    def _takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        fits = x.ndim == 2 and 0 < x.shape[0] <= self.max_rows and x.dtype == weight.dtype
        return fits and x.stride(1) == 1 and weight.stride(1) == 1 and (x.is_cuda or self._is_interpreting())

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._takes(x, weight):
            return self._gemv(x, weight)
        return F.linear(x, weight)

    def runs_gemv(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return self._takes(x, weight)

    def gated_norm_linear(
        self,
        x: torch.Tensor,
        gate: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        norm_after: AddNorm | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """One-row steps (``max_rows`` >= 1): kernels/gemv/gated_norm.py, the norm inside the GEMV's loads (and the
        norm after it by the last program: ``linear_norm_after``)."""
        if self.max_rows < 1 or not (x.is_cuda or self._is_interpreting()):
            return None
        if not self._gated_fits(x, gate, weight, norm_weight.numel()):
            return None
        if norm_after is None:
            return self._gated_norm_gemv(x, gate, norm_weight, eps, weight)
        if not self._norm_after_fits(x, weight, norm_after):
            return None
        return self._gated_norm_gemv_norm_after(x, gate, norm_weight, eps, weight, self._after(x, norm_after))

    def fuses_norm_after(self, rows: int) -> bool:
        """One-row steps with ``norm_after`` on (``TANDEM_GEMV_NORM_AFTER``): kernels/gemv/norm_after.py."""
        return self.norm_after and rows == 1 <= self.max_rows

    def linear_norm_after(
        self, x: torch.Tensor, weight: torch.Tensor, norm_after: AddNorm
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self._takes(x, weight) or not self._norm_after_fits(x, weight, norm_after):
            return None
        return self._gemv_norm_after(x, weight, self._after(x, norm_after))

    def _norm_after_fits(self, x: torch.Tensor, weight: torch.Tensor, an: AddNorm) -> bool:
        n = weight.shape[0]
        r = an.residual
        return (
            self.fuses_norm_after(x.shape[0])
            and n > 0
            and r.shape == (1, n)
            and r.stride(1) == 1
            and an.weight.shape == (n,)
            and r.device == an.weight.device == x.device
        )

    def _after(self, x: torch.Tensor, an: AddNorm):
        """The kernels' ``NormAfter`` (the ticket is made on the first call: an eager step, before any capture)."""
        return self._norm_after_args(an.residual, an.weight, an.eps, self._ticket.get(x.device))

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
    program re-reads the whole row for its sum of squares), docs/PERFORMANCE.md, twenty-eighth session.
    ``TANDEM_GEMV_NORM_AFTER``: ``1`` (default) the post-attention norm run by the last program of the attention's
    output projection at one row (kernels/gemv/norm_after.py), ``0`` its own launch."""
    gemv = env_switch("TANDEM_GEMV", True)
    add_norm, norm_after = env_switch("TANDEM_GEMV_ADD_NORM", False), env_switch("TANDEM_GEMV_NORM_AFTER", True)
    return TritonDense(add_norm=add_norm, norm_after=norm_after) if gemv else TorchDense()


__all__ = ["DENSE_GEMV_MAX_ROWS", "TorchDense", "TritonDense", "gpu_dense_backend"]
