"""engine/backends/norm.py: fla's fused RMS norms, called through ``layer_norm_fwd`` directly, against fla's
public ``rms_norm`` (bit for bit: same kernel, same arguments) and against the reference norms (HF numerics).
fla's norm kernels are autotuned, which needs a Triton driver: the GPU checks need CUDA; on the host the
backend must fall back to the reference."""

from __future__ import annotations

import pytest
import torch

from engine.backends.norm import FlaNormBackend, TorchNormBackend
from tests.kernels.helpers import DEVICE, assert_close, needs_cuda

pytestmark = pytest.mark.usefixtures("fla_unblocked")


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, res = (torch.randn(*shape, generator=g).to(DEVICE, dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE, dtype)
    return x, res, weight


def test_host_tensors_take_the_reference():
    x, res, w = (t.cpu() for t in _inputs((5, 64), torch.float32))
    fla, ref = FlaNormBackend(), TorchNormBackend()
    assert torch.equal(fla.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    for a, b in zip(fla.add_rms_norm(x, res, w, 1e-6), ref.add_rms_norm(x, res, w, 1e-6), strict=True):
        assert torch.equal(a, b)


@needs_cuda
@pytest.mark.parametrize("shape", [(3, 2304), (8192, 2304), (2, 7, 512)], ids=["decode", "8k", "3d"])
def test_direct_call_is_flas_rms_norm(shape):
    from fla.modules.norm.layernorm import rms_norm

    x, res, w = _inputs(shape, torch.bfloat16, seed=1)
    be = FlaNormBackend()
    assert torch.equal(be.rms_norm(x, w, 1e-6), rms_norm(x, w, None, eps=1e-6))
    y, r = be.add_rms_norm(x, res, w, 1e-6)
    ref_y, ref_r = rms_norm(x, w, None, residual=res, eps=1e-6, prenorm=True)
    assert torch.equal(y, ref_y) and torch.equal(r, ref_r)
    assert y.shape == x.shape and r.shape == x.shape
    want_y, want_r = TorchNormBackend().add_rms_norm(x.float(), res.float(), w.float(), 1e-6)
    assert_close("y vs reference", want_y, y.float(), 2e-2)
    assert_close("residual vs reference", want_r, r.float(), 1e-2)
