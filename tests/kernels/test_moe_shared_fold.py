"""The shared expert folded into the routed experts' decode kernels (SparseMoE.pack_weights stores it as expert E
of the packed weights; GPUMoEBackend.folds_shared at decode sizes; the route kernel's extra column): the same
function as the separate shared MLP, no extra memory, and the separate MLP does not run when folded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.backends import Backends
from engine.backends.gpu import FOLD_SHARED_MAX_TOKENS, GPUMoEBackend
from engine.backends.torch_ref import TorchAttentionBackend, TorchKDABackend, TorchMoEBackend
from engine.models.kimi_linear import SparseMoE
from kernels.moe.triton import sigmoid_topk_route_triton
from tests.kernels.helpers import DEVICE, assert_close


def test_route_writes_the_extra_column_in_the_same_launch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 16, generator=gen).to(DEVICE)
    bias = (torch.randn(16, generator=gen) * 0.1).to(DEVICE)
    w, ids = sigmoid_topk_route_triton(logits, bias, 4, True, 2.5)
    w_x, ids_x = sigmoid_topk_route_triton(logits, bias, 4, True, 2.5, extra_expert=16)
    assert ids_x.shape == (5, 5) and torch.equal(ids_x[:, :4], ids)
    assert_close("weights", w, w_x[:, :4], 1e-6)  # a wider tile: the renormalising sum may round differently
    assert torch.equal(ids_x[:, 4], torch.full((5,), 16, device=DEVICE)) and torch.equal(
        w_x[:, 4], torch.ones(5, device=DEVICE)
    )
    w_r, ids_r = TorchMoEBackend().route(logits, bias, 4, True, 2.5, extra_expert=16)
    assert torch.equal(ids_r[:, 4], ids_x[:, 4]) and torch.equal(w_r[:, 4], w_x[:, 4])
    with pytest.raises(ValueError, match="extra_expert"):
        sigmoid_topk_route_triton(logits, bias, 4, True, 2.5, extra_expert=3)


def _moe(seed: int = 0) -> SparseMoE:
    cfg = SimpleNamespace(  # the fields SparseMoE reads
        hidden_size=32,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_renormalize=True,
        routed_scaling_factor=2.5,
    )
    moe = SparseMoE(cfg).to(DEVICE)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return moe


@pytest.mark.parametrize("tokens", [1, 5, FOLD_SHARED_MAX_TOKENS, FOLD_SHARED_MAX_TOKENS + 3])
def test_folded_shared_expert_is_the_same_function(tokens, monkeypatch):
    moe = _moe()
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ref = Backends(TorchAttentionBackend(), TorchKDABackend(), TorchMoEBackend())
    want = moe(x, ref)
    before = sum(p.numel() for p in moe.parameters())
    moe.pack_weights()
    moe.shared_experts.pack_weights()  # as CausalLM.pack_weights reaches it after its MoE block: keeps the views
    assert sum(p.numel() for p in moe.parameters()) == before
    ptr = moe._with_shared[3].untyped_storage().data_ptr()
    sh = moe.shared_experts
    assert sh.gate_up.weight.untyped_storage().data_ptr() == ptr == moe.experts.w1.untyped_storage().data_ptr()
    assert sh.down_proj.weight.untyped_storage().data_ptr() == moe.experts.w2.untyped_storage().data_ptr()
    gpu = GPUMoEBackend(decode_kernels=True)
    be = Backends(TorchAttentionBackend(), TorchKDABackend(), gpu)
    folds = tokens <= FOLD_SHARED_MAX_TOKENS
    assert gpu.folds_shared(tokens) == folds
    shared_runs = []
    real = type(sh).forward
    monkeypatch.setattr(type(sh), "forward", lambda self, x, be=None: shared_runs.append(1) or real(self, x, be))
    got = moe(x, be)
    assert bool(shared_runs) != folds  # folded: the separate MLP did not run
    assert_close("moe", want, got, 1e-5)
    assert_close("moe, reference backends after packing", want, moe(x, ref), 1e-5)
    monkeypatch.setenv("TANDEM_MOE_FOLD_SHARED", "0")
    assert not GPUMoEBackend(decode_kernels=True).folds_shared(1)
