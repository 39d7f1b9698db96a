"""kernels/gemv/add_norm.py: a layer's input norm (after the residual add) inside its first projection's launch,
against the two steps it replaces (kernels/gemv/naive.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv.add_norm import add_norm_gemv, add_norm_gemv_fits
from kernels.gemv.naive import naive_add_norm_gemv
from tests.kernels.helpers import DEVICE, ON_CUDA, assert_close, tol


def _inputs(n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, k, generator=g) * 2).to(DEVICE, dtype)
    residual = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(DEVICE, dtype)
    return x, residual, norm_w, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first_layer"])
@pytest.mark.parametrize(("n", "k"), [(40, 64), (33, 100), (70, 300)])
def test_add_norm_gemv_matches_two_steps(n, k, dtype, with_residual):
    x, residual, norm_w, w = _inputs(n, k, dtype)
    r = residual if with_residual else None
    want_y, want_res = naive_add_norm_gemv(x, r, norm_w, 1e-6, w)
    got_y, got_res = add_norm_gemv(x, r, norm_w, 1e-6, w)
    assert_close("add_norm_gemv", want_y, got_y, tol(dtype))
    # the residual sum: one rounding of the same fp32 sum (the interpreter rounds fp32 -> bf16 toward zero)
    torch.testing.assert_close(got_res.float(), want_res.float(), rtol=0 if dtype == torch.float32 else 2**-7, atol=0)
    if with_residual:
        assert got_res.data_ptr() not in (x.data_ptr(), residual.data_ptr())  # never written over its inputs
        # the norm is over x + residual: the residual matters
        assert not torch.allclose(add_norm_gemv(x, None, norm_w, 1e-6, w)[0].float(), got_y.float())
    else:
        assert got_res is x
    # and so does the norm's weight
    assert not torch.allclose(add_norm_gemv(x, r, norm_w.flip(0), 1e-6, w)[0].float(), got_y.float())


def test_add_norm_gemv_rejects_what_it_cannot_fuse():
    x, residual, norm_w, w = _inputs(16, 32, torch.float32)
    two = torch.cat([x, x])
    with pytest.raises(ValueError, match="add_norm_gemv takes x"):
        add_norm_gemv(two, None, norm_w, 1e-6, w)  # two rows
    with pytest.raises(ValueError, match="norm_weight"):
        add_norm_gemv(x, residual, norm_w[:-1], 1e-6, w)
    assert not add_norm_gemv_fits(x, residual[:, :16], w)  # a residual of another shape
    assert not add_norm_gemv_fits(x, residual.double(), w)
    assert not add_norm_gemv_fits(x, None, w[:, :16])  # K mismatch
    assert add_norm_gemv_fits(x, residual, w)


@pytest.mark.skipif(not ON_CUDA, reason="Kimi mid shapes (31-85 MB weights): too slow for the interpreter")
@pytest.mark.parametrize(("n", "k"), [(12576, 2304), (6720, 2304), (18432, 2304)])
def test_mid_shapes_on_the_gpu(n, k):
    x, residual, norm_w, w = _inputs(n, k, torch.bfloat16, seed=3)
    want_y, want_res = naive_add_norm_gemv(x, residual, norm_w, 1e-6, w)
    got_y, got_res = add_norm_gemv(x, residual, norm_w, 1e-6, w)
    assert_close("add_norm_gemv mid", want_y, got_y, 2e-2)
    assert torch.equal(got_res, want_res)  # round to nearest even on the GPU, as torch


def test_dense_backend_fuses_one_row_steps_only_when_switched_on(monkeypatch):
    from engine.backends.dense import TorchDense, TritonDense, gpu_dense_backend

    x, residual, norm_w, w = _inputs(24, 48, torch.float32)
    assert TritonDense().add_norm_linear(x, residual, norm_w, 1e-6, w) is None  # off by default
    fused = TritonDense(add_norm=True).add_norm_linear(x, residual, norm_w, 1e-6, w)
    assert fused is not None
    assert_close("backend add_norm", naive_add_norm_gemv(x, residual, norm_w, 1e-6, w)[0], fused[0], 1e-5)
    two_rows = torch.cat([x, x])
    assert TritonDense(add_norm=True).add_norm_linear(two_rows, None, norm_w, 1e-6, w) is None  # the norm's launch
    assert TorchDense().add_norm_linear(x, residual, norm_w, 1e-6, w) is None  # the reference never fuses

    monkeypatch.setenv("TANDEM_GEMV", "1")
    monkeypatch.delenv("TANDEM_GEMV_ADD_NORM", raising=False)
    off = gpu_dense_backend()
    assert isinstance(off, TritonDense) and off.add_norm_linear(x, residual, norm_w, 1e-6, w) is None
    monkeypatch.setenv("TANDEM_GEMV_ADD_NORM", "1")
    assert gpu_dense_backend().add_norm_linear(x, residual, norm_w, 1e-6, w) is not None
    monkeypatch.setenv("TANDEM_GEMV_ADD_NORM", "2")
    with pytest.raises(ValueError, match="TANDEM_GEMV_ADD_NORM must be 0 or 1"):
        gpu_dense_backend()
