"""Triton page gather / scatter vs kernels/page_copy/naive.py."""

from __future__ import annotations

import pytest
import torch

from kernels.page_copy.naive import naive_pack_pages, naive_unpack_pages
from kernels.page_copy.triton import pack_pages, unpack_pages
from tests.kernels.helpers import DEVICE

ENTRIES = {"mla": (40,), "gqa": (2, 2, 16)}  # tiny-4L MLA latent (32 + 8); GQA K|V, 2 heads x 16


def _caches(layers, page_size, entry, dtype, num_pages=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_pages, page_size, *entry, generator=g).to(DEVICE, dtype) for _ in range(layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("start", "num_tokens"), [(0, 1), (0, 37), (5, 17), (16, 16), (13, 0)])
@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("layers", [1, 3])
def test_pack_unpack_roundtrip(layers, entry, start, num_tokens, dtype):
    page_size = 8
    caches = _caches(layers, page_size, ENTRIES[entry], dtype)
    table = torch.randperm(12, generator=torch.Generator().manual_seed(1))[:7].to(DEVICE)
    packed = pack_pages(caches, table, start, num_tokens)
    ref = naive_pack_pages(caches, table, start, num_tokens)
    assert packed.shape == (layers, num_tokens, *ENTRIES[entry]) and packed.dtype == dtype
    assert torch.equal(packed, ref)

    new = torch.randn_like(packed.float()).to(dtype)
    mine, theirs = [c.clone() for c in caches], [c.clone() for c in caches]
    unpack_pages(mine, table, start, new)
    naive_unpack_pages(theirs, table, start, new)
    for a, b in zip(mine, theirs, strict=True):
        assert torch.equal(a, b)  # only the range's rows changed, bit-exact


def test_pack_into_given_buffer():
    caches = _caches(2, 4, (8,), torch.float32)
    table = torch.arange(6, device=DEVICE)
    out = torch.empty(2, 10, 8, device=DEVICE)
    assert pack_pages(caches, table, 3, 10, out=out) is out
    assert torch.equal(out, naive_pack_pages(caches, table, 3, 10))


def test_rejects_short_block_table_and_mixed_caches():
    caches = _caches(2, 4, (8,), torch.float32)
    with pytest.raises(ValueError, match="need 3 pages"):
        pack_pages(caches, torch.arange(2, device=DEVICE), 2, 9)
    with pytest.raises(ValueError, match="share shape"):
        pack_pages([caches[0], caches[1][:, :2]], torch.arange(4, device=DEVICE), 0, 4)
