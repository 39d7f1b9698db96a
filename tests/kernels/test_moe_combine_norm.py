"""kernels/moe/combine_norm.py: the one-token combine with the next norm in its launch, against its contract
(``moe_combine`` then fla's add-norm numerics) and against the two launches it replaces."""

from __future__ import annotations

import pytest
import torch

from kernels.moe.combine import moe_combine_triton
from kernels.moe.combine_norm import moe_combine_add_norm, naive_combine_add_norm
from tests.kernels.helpers import DEVICE
from tests.kernels.one_row_engine import one_row_launches


def _inputs(t: int, k: int, h: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(t * k, h, generator=g).to(dtype)
    rows = torch.randperm(t * k, generator=g)
    weights = torch.rand(t, k, generator=g)
    residual = (torch.randn(t, h, generator=g) * 3).to(dtype)
    norm_w = (torch.rand(h, generator=g) + 0.5).to(dtype)
    return [v.to(DEVICE) for v in (y, rows, weights, residual, norm_w)]


@pytest.mark.parametrize(("t", "k", "h"), [(1, 9, 2304), (1, 8, 100), (3, 2, 64)])
@pytest.mark.parametrize("pair_order", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_contract(t, k, h, pair_order, dtype):
    y, rows, weights, residual, norm_w = _inputs(t, k, h, dtype, seed=t * 7 + k)
    rows = None if pair_order else rows
    got_y, got_res = moe_combine_add_norm(y, rows, weights, residual, norm_w, 1e-6, dtype)
    want_y, want_res = naive_combine_add_norm(y, rows, weights, residual, norm_w, 1e-6, dtype)
    assert got_y.dtype == dtype and got_res.dtype == residual.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got_res, want_res, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_y, want_y, rtol=1e-5, atol=1e-5)
    else:  # the sums' order differs from torch's: the combine's bf16 output may round one way or the other, and
        # that ulp (of the combine's magnitude, up to ~16 here) carries into the sum and the norm
        torch.testing.assert_close(got_res.float(), want_res.float(), rtol=1.6e-2, atol=0.13)
        torch.testing.assert_close(got_y.float(), want_y.float(), rtol=1.6e-2, atol=0.13)


def test_equals_the_combine_then_the_norm():
    """The pair the layer would get from the separate combine launch and the next RMSNorm.add (reference norm
    backend; fp32, where fla's numerics and HF's coincide)."""
    from engine.backends.norm import TorchNormBackend

    y, _, weights, residual, norm_w = _inputs(1, 9, 256, torch.float32, seed=3)
    combined = moe_combine_triton(y, None, weights, torch.float32)
    want_y, want_res = TorchNormBackend().add_rms_norm(combined, residual, norm_w, 1e-5)
    got_y, got_res = moe_combine_add_norm(y, None, weights, residual, norm_w, 1e-5, torch.float32)
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)
    torch.testing.assert_close(got_y, want_y, rtol=1e-6, atol=1e-6)


def test_bad_shapes_say_what_is_wrong():
    y, _, weights, residual, norm_w = _inputs(1, 4, 32, torch.float32, seed=1)
    with pytest.raises(ValueError, match="residual"):
        moe_combine_add_norm(y, None, weights, residual[:, :16], norm_w, 1e-6, torch.float32)
    with pytest.raises(ValueError, match="norm_weight"):
        moe_combine_add_norm(y, None, weights, residual, norm_w[:8], 1e-6, torch.float32)
    with pytest.raises(ValueError, match="y must be"):
        moe_combine_add_norm(y[:3], None, weights, residual, norm_w, 1e-6, torch.float32)


# ---- in the engine ------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("fla_unblocked")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU engine with interpreted kernels")
@pytest.mark.parametrize("combine_norm", ["1", "0"])
def test_one_token_steps_run_the_next_norm_in_the_combine(tiny_models, monkeypatch, combine_norm):
    """Greedy tokens of the tiny Kimi model with the GPU backends, one sequence at a time (every decode step one
    row: the pair-row experts with the shared expert folded), weights packed as on CUDA: the same as the reference
    backends with the fused combine + norm on (it ran, once per MoE layer a decode step) and off (it did not)."""
    monkeypatch.setenv("TANDEM_MOE_COMBINE_NORM", combine_norm)
    monkeypatch.setenv("TANDEM_MOE_DOWN_NORM", "0")  # its own launch (the down launch's: test_moe_down_norm.py)
    rows, one_row_blocks = one_row_launches(tiny_models, monkeypatch, ["moe_combine_add_norm"])
    assert len(rows["moe_combine_add_norm"]) == (one_row_blocks if combine_norm == "1" else 0)
