"""kernels/paged_attention/latent_write.py (MLA's cache write in one launch) vs naive.write_mla_latent, and the
GPU attention backend's ``write_mla_latent`` vs the model's form (norm, concatenation, ``write_kv``)."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention.latent_write import write_mla_latent_triton
from kernels.paged_attention.naive import write_mla_latent
from tests.kernels.helpers import DEVICE, assert_close


def _inputs(t, rank, rope, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(t, 40 + rank + rope, generator=gen).to(DEVICE, dtype)
    kv_a = wide[:, 24 : 24 + rank + rope]  # a column view of a wider projection output, as the packed GEMM gives
    weight = (1 + 0.1 * torch.randn(rank, generator=gen)).to(DEVICE, dtype)
    return kv_a, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rank", "rope"), [(32, 8), (512, 64), (48, 0)])
def test_latent_write_matches_the_reference(rank, rope, dtype):
    t, pages, page = 7, 6, 4
    kv_a, weight = _inputs(t, rank, rope, dtype)
    slots = torch.tensor([5, -1, 0, 23, 9, -1, 14], device=DEVICE)  # -1: prefix-cached rows, not written
    fill = torch.randn(pages, page, rank + rope).to(DEVICE, dtype)
    want, got = fill.clone(), fill.clone()
    write_mla_latent(want, slots, kv_a, weight, 1e-6, rank)
    write_mla_latent_triton(got, slots, kv_a, weight, 1e-6, rank)
    assert_close("cache", want, got, 1e-6 if dtype == torch.float32 else 1e-2)
    untouched = torch.ones(pages * page, dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(got.view(pages * page, -1)[untouched], fill.view(pages * page, -1)[untouched])
    if rope:  # k_pe is copied, not normed
        assert torch.equal(got.view(pages * page, -1)[5, rank:], kv_a[0, rank:])


def test_latent_write_validates():
    kv_a, weight = _inputs(3, 32, 8, torch.float32)
    cache = torch.zeros(2, 4, 40, device=DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="cache must be"):
        write_mla_latent_triton(torch.zeros(2, 4, 41, device=DEVICE), slots, kv_a, weight, 1e-6, 32)
    with pytest.raises(ValueError, match="norm_weight"):
        write_mla_latent_triton(cache, slots, kv_a, weight[:8], 1e-6, 32)
    with pytest.raises(ValueError, match="unit last stride"):
        write_mla_latent_triton(cache, slots, kv_a.t().contiguous().t(), weight, 1e-6, 32)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_mla_latent_triton(cache, slots[:2], kv_a, weight, 1e-6, 32)


def test_backend_write_is_the_models_form():
    """GPUAttentionBackend.write_mla_latent (one launch) vs AttentionBackend's default (the model's norm, the
    concatenation, write_kv) on a batch with a prefix-cached row (slot -1)."""
    from engine.backends.gpu import GPUAttentionBackend
    from engine.backends.norm import TorchNormBackend
    from engine.backends.torch_ref import TorchAttentionBackend
    from tests.kernels.test_gpu_backend import make_batch

    batch = make_batch([3, 1], [5, 9], 4, 8)
    batch.slot_mapping[0] = -1
    batch.kv_write_rows = None
    kv_a, weight = _inputs(batch.num_tokens, 32, 8, torch.float32, seed=2)
    want, got = (torch.zeros(8, 4, 40, device=DEVICE) for _ in range(2))
    TorchAttentionBackend().write_mla_latent(want, batch, kv_a, 32, weight, 1e-6, TorchNormBackend())
    GPUAttentionBackend().write_mla_latent(got, batch, kv_a, 32, weight, 1e-6, TorchNormBackend())
    assert_close("cache", want, got, 1e-6)
    assert want.abs().sum() > 0
