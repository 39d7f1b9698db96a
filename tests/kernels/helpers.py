"""Shared bits of the kernel tests (conftest.py sets up the interpreter before these are imported)."""

from __future__ import annotations

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs CUDA (fla's chunk_kda cannot run under TRITON_INTERPRET)")


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, ratio: float, atol: float = 0.0) -> None:
    """FLA-style check: relative RMS error ||ref - out|| / ||ref|| < ratio, or max |diff| <= atol; no NaN."""
    ref, out = ref.detach().float().cpu(), out.detach().float().cpu()
    assert ref.shape == out.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{name}: NaN in output"
    diff = (ref - out).abs()
    max_abs = diff.max().item() if diff.numel() else 0.0
    if max_abs <= atol:
        return
    rel = (diff.pow(2).sum().sqrt() / ref.pow(2).sum().sqrt().clamp_min(1e-12)).item()
    assert rel < ratio, f"{name}: relative RMS error {rel:.3g} >= {ratio} (max abs diff {max_abs:.3g})"


def tol(dtype: torch.dtype) -> float:
    """Relative RMS tolerance per dtype (GPU fp32: exp2 / FMA ordering differ from torch's by a few ulp)."""
    if dtype == torch.float32:
        return 2e-5 if ON_CUDA else 5e-6
    return 1e-2
