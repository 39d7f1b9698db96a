"""kernels/moe/router.py (the decode router GEMV as split-K partial sums) vs naive_router_partials, and the route
kernel taking those partials (added in split order) against the route of their sum."""

from __future__ import annotations

import pytest
import torch

from kernels.moe.naive import naive_router_partials, sum_partials
from kernels.moe.router import router_partials
from kernels.moe.triton import sigmoid_topk_route_triton
from tests.kernels.helpers import DEVICE, assert_close


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("t", "h", "e", "split"), [(1, 2304, 256, 256), (5, 200, 40, 64), (16, 96, 24, 32), (64, 64, 16, 16)]
)
def test_partials_match_the_reference(t, h, e, split, dtype):
    gen = torch.Generator().manual_seed(t + h)
    x = torch.randn(t, h, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(e, h, generator=gen) / h**0.5).to(DEVICE, dtype)
    got = router_partials(x, w, split)
    want = naive_router_partials(x, w, split)
    assert got.shape == want.shape == (-(-h // split), t, e) and got.dtype == torch.float32
    assert_close("partials", want, got, 1e-5, atol=1e-5)
    # the sum is the router's logits: x @ w^T in fp32
    assert_close("logits", x.float() @ w.float().t(), sum_partials(got), 1e-5, atol=1e-5)


@pytest.mark.parametrize("extra", [None, 40])
def test_route_adds_the_partials_in_split_order(extra):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 160, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(40, 160, generator=gen) / 13).to(DEVICE, torch.bfloat16)
    bias = (0.1 * torch.randn(40, generator=gen)).to(DEVICE)
    partials = router_partials(x, w, 32)
    want = sigmoid_topk_route_triton(sum_partials(partials), bias, 4, True, 2.5, extra_expert=extra)
    got = sigmoid_topk_route_triton(partials, bias, 4, True, 2.5, extra_expert=extra)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])  # the same fp32 adds in the same order
    one = sigmoid_topk_route_triton(partials[:1], bias, 4, True, 2.5)  # a single split is plain logits
    assert torch.equal(one[1], sigmoid_topk_route_triton(partials[0], bias, 4, True, 2.5)[1])


def test_validates():
    x = torch.randn(2, 32, device=DEVICE)
    w = torch.randn(8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="share H"):
        router_partials(x, w[:, :16])
    with pytest.raises(ValueError, match="power of two"):
        router_partials(x, w, 24)
    with pytest.raises(ValueError, match="64 rows"):
        router_partials(torch.randn(65, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="dtype"):
        router_partials(x.to(torch.bfloat16), w)
    with pytest.raises(ValueError, match="partials"):
        sigmoid_topk_route_triton(torch.randn(2, 2, 3, 8, device=DEVICE), None, 2, True, 1.0)


@pytest.mark.parametrize("tokens", [1, 7, 16, 17])
def test_moe_block_with_the_split_router_is_the_same_function(tokens, monkeypatch):
    """SparseMoE through the GPU backend with router_gemv: the partials at <= ROUTER_GEMV_MAX_ROWS rows (route
    adds them), the router GEMM above; the block's output as with the reference backends."""
    from engine.backends import Backends
    from engine.backends.gpu import ROUTER_GEMV_MAX_ROWS, GPUMoEBackend
    from engine.backends.torch_ref import TorchAttentionBackend, TorchKDABackend, TorchMoEBackend
    from tests.kernels.test_moe_shared_fold import _moe

    moe = _moe()
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    want = moe(x, Backends(TorchAttentionBackend(), TorchKDABackend(), TorchMoEBackend()))
    gpu = GPUMoEBackend(decode_kernels=True, router_gemv=True, fused_route_rows=0)  # the two launches
    seen = []
    real = gpu.route
    monkeypatch.setattr(gpu, "route", lambda logits, *a, **k: seen.append(logits.ndim) or real(logits, *a, **k))
    got = moe(x, Backends(TorchAttentionBackend(), TorchKDABackend(), gpu))
    assert seen == [3 if tokens <= ROUTER_GEMV_MAX_ROWS else 2]
    assert_close("moe", want, got, 1e-5)
    monkeypatch.delenv("TANDEM_MOE_ROUTER_GEMV", raising=False)
    assert not GPUMoEBackend().router_gemv  # off unless asked for
    monkeypatch.setenv("TANDEM_MOE_ROUTER_GEMV", "1")
    assert GPUMoEBackend().router_gemv
