"""kernels/activation.py: on CUDA, SiLU(gate) * up goes through fla-core's swiglu on the strided halves of a
packed gate|up output. On this CPU the same fla kernel runs under the Triton interpreter, called as
``silu_mul`` calls it (so a changed fla entry point or signature fails here, not first on a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.activation as act
from tests.kernels.helpers import DEVICE, assert_close, tol

pytestmark = pytest.mark.usefixtures("fla_unblocked")


@pytest.fixture
def fresh_lookup():
    act._swiglu.cache_clear()  # looked up again, with fla importable
    yield
    act._swiglu.cache_clear()  # and not remembered once fla is blocked again


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_swiglu_on_packed_halves_is_silu_times_up(fresh_lookup, dtype):
    g = torch.Generator().manual_seed(0)
    h13 = torch.randn(37, 2 * 48, generator=g).to(DEVICE, dtype)
    gate, up = h13[:, :48], h13[:, 48:]  # strided views, as GatedMLP / grouped_moe pass them
    swiglu = act._swiglu()
    assert swiglu is not None
    got = swiglu(gate, up)
    want = (F.silu(gate.float()) * up.float()).to(dtype)
    assert got.shape == gate.shape and got.dtype == dtype
    assert_close("swiglu", want.float(), got.float(), tol(dtype) if dtype == torch.float32 else 1e-2)
    assert_close(
        "silu_mul", want.float(), act.silu_mul(gate, up).float(), tol(dtype) if dtype == torch.float32 else 1e-2
    )
