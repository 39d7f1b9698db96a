"""kernels/moe/route_fused.py (the router GEMV and its top-k in one launch) against the two launches it replaces
(``router_partials`` then ``sigmoid_topk_route_triton``: bit for bit) and against the reference routing of the
router's logits; the ticket's reset across launches and graph replays; the backend's choice of path."""

from __future__ import annotations

import pytest
import torch

from kernels.moe.naive import naive_router_partials, sigmoid_topk_route, sum_partials
from kernels.moe.route_fused import RouteTicket, router_route
from kernels.moe.router import router_partials
from kernels.moe.triton import sigmoid_topk_route_triton
from tests.kernels.helpers import DEVICE, ON_CUDA, assert_close


def _inputs(t: int, h: int, e: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + t + h)
    x = torch.randn(t, h, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(e, h, generator=gen) / h**0.5).to(DEVICE, dtype)
    bias = (0.1 * torch.randn(e, generator=gen)).to(DEVICE)
    return x, w, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("t", "h", "e", "k", "split", "extra"),
    [(1, 2304, 256, 8, 256, 256), (1, 2304, 256, 8, 256, None), (3, 200, 40, 4, 64, 40), (5, 96, 24, 6, 32, None)],
)
def test_equals_the_two_launches_bit_for_bit(t, h, e, k, split, extra, dtype):
    x, w, bias = _inputs(t, h, e, dtype)
    ticket = RouteTicket().get(x.device)
    want = sigmoid_topk_route_triton(router_partials(x, w, split), bias, k, True, 2.446, extra_expert=extra)
    for _ in range(2):  # the second launch finds the ticket put back to 0
        got = router_route(x, w, ticket, bias, k, True, 2.446, extra_expert=extra, split=split)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
        assert ticket.item() == 0
    assert got[0].shape == got[1].shape == (t, k + (extra is not None))


@pytest.mark.parametrize("renormalize", [True, False])
def test_routes_the_router_logits_as_the_reference(renormalize):
    x, w, bias = _inputs(4, 160, 32, torch.float32, seed=7)
    ticket = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    w_got, ids_got = router_route(x, w, ticket, bias, 5, renormalize, 1.5, split=32)
    logits = sum_partials(naive_router_partials(x, w, 32))
    w_ref, ids_ref = sigmoid_topk_route(logits, bias, 5, renormalize, 1.5)
    order = ids_ref.sort(dim=1)  # the reference's topk is unsorted; the kernel's picks come best first
    got_order = ids_got.sort(dim=1)
    assert torch.equal(got_order.values.cpu(), order.values.cpu())
    assert_close("weights", w_ref.gather(1, order.indices), w_got.gather(1, got_order.indices), 1e-6, atol=1e-6)
    # a changed router weight changes the routing: the kernel reads the weight it is given
    w2 = w.clone()
    w2[ids_got[0, 0]] = -10.0 * x[0]  # row 0's logit for its best expert: -10 |x_0|^2
    assert ids_got[0, 0] not in router_route(x, w2, ticket, bias, 5, renormalize, 1.5, split=32)[1][0]


@pytest.mark.skipif(not ON_CUDA, reason="a CUDA graph needs CUDA (the interpreter runs programs one by one)")
def test_ticket_survives_graph_replays():
    """Programs really run concurrently here: every replay with new rows equals the two launches."""
    x, w, bias = _inputs(1, 2304, 256, torch.bfloat16)
    ticket = RouteTicket().get(x.device)
    router_route(x, w, ticket, bias, 8, True, 2.446, extra_expert=256)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w_out, ids_out = router_route(x, w, ticket, bias, 8, True, 2.446, extra_expert=256)
    gen = torch.Generator().manual_seed(11)
    for _ in range(50):
        x.copy_(torch.randn(x.shape, generator=gen).to(x))
        graph.replay()
        want = sigmoid_topk_route_triton(router_partials(x, w), bias, 8, True, 2.446, extra_expert=256)
        assert torch.equal(ids_out, want[1]) and torch.equal(w_out, want[0])
    assert ticket.item() == 0


def test_validates():
    x, w, bias = _inputs(2, 64, 16, torch.float32)
    ticket = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="ticket"):
        router_route(x, w, ticket.long(), bias, 2, True, 1.0, split=32)
    with pytest.raises(ValueError, match="64 rows"):
        router_route(torch.randn(65, 64, device=DEVICE), w, ticket, bias, 2, True, 1.0, split=32)
    with pytest.raises(ValueError, match="top_k"):
        router_route(x, w, ticket, bias, 17, True, 1.0, split=32)
    with pytest.raises(ValueError, match="extra_expert"):
        router_route(x, w, ticket, bias, 2, True, 1.0, extra_expert=3, split=32)
    with pytest.raises(ValueError, match="power of two"):
        router_route(x, w, ticket, bias, 2, True, 1.0, split=24)


@pytest.mark.parametrize("tokens", [1, 4, 5])
def test_backend_routes_small_steps_in_one_launch(tokens, monkeypatch):
    """SparseMoE through the GPU backend: one fused launch at <= fused_route_rows rows, the router GEMM and the
    route kernel above; the block's output as with the reference backends either way."""
    import engine.backends.gpu_moe as gpu_mod
    from engine.backends import Backends
    from engine.backends.gpu import GPUMoEBackend
    from engine.backends.torch_ref import TorchAttentionBackend, TorchKDABackend, TorchMoEBackend
    from tests.kernels.test_moe_shared_fold import _moe

    moe = _moe()
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    want = moe(x, Backends(TorchAttentionBackend(), TorchKDABackend(), TorchMoEBackend()))
    gpu = GPUMoEBackend(decode_kernels=True, fused_route_rows=4)
    fused = []
    real = gpu_mod.router_route
    monkeypatch.setattr(gpu_mod, "router_route", lambda *a, **k: fused.append(a[0].shape[0]) or real(*a, **k))
    got = moe(x, Backends(TorchAttentionBackend(), TorchKDABackend(), gpu))
    assert fused == ([tokens] if tokens <= 4 else [])
    assert_close("moe", want, got, 1e-5)


def test_rows_switch(monkeypatch):
    from engine.backends.gpu import FUSED_ROUTE_MAX_ROWS, GPUMoEBackend

    monkeypatch.delenv("TANDEM_MOE_FUSED_ROUTE_ROWS", raising=False)
    assert GPUMoEBackend().fused_route_rows == FUSED_ROUTE_MAX_ROWS
    monkeypatch.setenv("TANDEM_MOE_FUSED_ROUTE_ROWS", "0")
    assert GPUMoEBackend().fused_route_rows == 0
    monkeypatch.setenv("TANDEM_MOE_FUSED_ROUTE_ROWS", "one")
    with pytest.raises(ValueError, match="TANDEM_MOE_FUSED_ROUTE_ROWS"):
        GPUMoEBackend()
