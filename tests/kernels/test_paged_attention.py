"""Triton paged attention (GQA and MLA, decode / chunked prefill / mixed) vs kernels/paged_attention/naive.py."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention.naive import paged_gqa_attention, paged_mla_attention
from kernels.paged_attention.triton import (
    build_attn_meta,
    pack_block_tables,
    paged_gqa_attention_triton,
    paged_mla_attention_triton,
)
from tests.kernels.helpers import DEVICE, assert_close, tol

# (q_lens, context_lens): decode, first chunks (no prefix), later chunks over a cached prefix, and mixes.
# Contexts are page-unaligned and odd; several sequences per batch (varlen).
SCENARIOS = {
    "decode": ([1, 1, 1], [1, 37, 130]),
    "prefill": ([13, 1, 29], [13, 1, 29]),
    "chunked": ([7, 33], [40, 61]),
    "mixed": ([1, 21, 1, 5], [77, 21, 3, 50]),
}


def _batch(q_lens, ctx_lens, page_size, num_pages, seed=0):
    """query_start_loc, block tables of shuffled pages (each sequence gets one spare page)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_pages, generator=g)
    qsl, tables, used = [0], [], 0
    for ql, ctx in zip(q_lens, ctx_lens, strict=True):
        qsl.append(qsl[-1] + ql)
        n = -(-ctx // page_size) + 1
        tables.append(perm[used : used + n].to(DEVICE))
        used += n
    assert used <= num_pages
    return qsl, tables


def _pages_needed(ctx_lens, page_size):
    return sum(-(-c // page_size) + 1 for c in ctx_lens)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "page_size", "dtype"),
    [
        (4, 4, 32, 16, torch.float32),  # MHA
        (8, 2, 64, 4, torch.float32),  # GQA group 4, small pages
        (6, 2, 40, 16, torch.float32),  # odd group (3), non-power-of-2 head dim
        (8, 2, 64, 16, torch.bfloat16),
    ],
    ids=lambda p: str(p).replace("torch.", ""),
)
def test_gqa(scenario, hq, hkv, d, page_size, dtype):
    q_lens, ctx = SCENARIOS[scenario]
    num_pages = _pages_needed(ctx, page_size) + 3
    torch.manual_seed(0)
    kv = torch.randn(num_pages, page_size, 2, hkv, d, device=DEVICE).to(dtype)
    qsl, tables = _batch(q_lens, ctx, page_size, num_pages)
    q = torch.randn(qsl[-1], hq, d, device=DEVICE).to(dtype)
    scale = d**-0.5
    ref = paged_gqa_attention(q.float(), kv.float(), qsl, ctx, tables, scale)
    out = paged_gqa_attention_triton(q, kv, qsl, ctx, tables, scale)
    assert out.dtype == dtype
    assert_close("o", ref, out, tol(dtype))


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("scenario", ["decode", "mixed"])
def test_gqa_split_kv(scenario, num_splits):
    """Flash-decoding: the key axis split in parts merged by log-sum-exp (with empty parts for short rows)."""
    q_lens, ctx = SCENARIOS[scenario]
    page_size, hq, hkv, d = 8, 4, 2, 32
    num_pages = _pages_needed(ctx, page_size)
    torch.manual_seed(1)
    kv = torch.randn(num_pages, page_size, 2, hkv, d, device=DEVICE)
    qsl, tables = _batch(q_lens, ctx, page_size, num_pages, seed=1)
    q = torch.randn(qsl[-1], hq, d, device=DEVICE)
    ref = paged_gqa_attention(q, kv, qsl, ctx, tables, 0.2)
    out = paged_gqa_attention_triton(q, kv, qsl, ctx, tables, 0.2, num_splits=num_splits, block_n=16)
    assert_close("o", ref, out, tol(torch.float32))


# MLA dims: the tiny-4L model's, and a wider set with nope != v and non-power-of-2 latent.
MLA_DIMS = {
    "tiny4L": dict(h=2, rank=32, rope=8, nope=16, v=16),
    "wide": dict(h=4, rank=48, rope=16, nope=32, v=24),
}


@pytest.mark.parametrize("form", ["absorbed", "expanded", "auto"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("dims", list(MLA_DIMS))
def test_mla(dims, scenario, form):
    h, rank, rope, nope, vd = (MLA_DIMS[dims][k] for k in ("h", "rank", "rope", "nope", "v"))
    q_lens, ctx = SCENARIOS[scenario]
    page_size = 16
    num_pages = _pages_needed(ctx, page_size) + 2
    torch.manual_seed(2)
    latent = torch.randn(num_pages, page_size, rank + rope, device=DEVICE)
    kv_b = torch.randn(h * (nope + vd), rank, device=DEVICE) * rank**-0.5
    qsl, tables = _batch(q_lens, ctx, page_size, num_pages, seed=2)
    q = torch.randn(qsl[-1], h, nope + rope, device=DEVICE)
    scale = (nope + rope) ** -0.5  # NoPE: the unrotated rope dims count in the scale
    ref = paged_mla_attention(q, latent, qsl, ctx, tables, kv_b, rank, nope, vd, scale)
    threshold = {"absorbed": None, "expanded": 0, "auto": 8}[form]  # auto: chunks >= 8 rows expanded
    out = paged_mla_attention_triton(
        q, latent, qsl, ctx, tables, kv_b, rank, nope, vd, scale, expand_min_q_len=threshold
    )
    assert_close("o", ref, out, tol(torch.float32))


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_mla_bf16(form):
    h, rank, rope, nope, vd = 4, 64, 16, 32, 32
    q_lens, ctx = SCENARIOS["mixed"]
    page_size = 16
    num_pages = _pages_needed(ctx, page_size)
    torch.manual_seed(3)
    latent = torch.randn(num_pages, page_size, rank + rope, device=DEVICE).bfloat16()
    kv_b = (torch.randn(h * (nope + vd), rank, device=DEVICE) * rank**-0.5).bfloat16()
    qsl, tables = _batch(q_lens, ctx, page_size, num_pages, seed=3)
    q = torch.randn(qsl[-1], h, nope + rope, device=DEVICE).bfloat16()
    scale = (nope + rope) ** -0.5
    ref = paged_mla_attention(q.float(), latent.float(), qsl, ctx, tables, kv_b.float(), rank, nope, vd, scale)
    out = paged_mla_attention_triton(
        q, latent, qsl, ctx, tables, kv_b, rank, nope, vd, scale, expand_min_q_len=None if form == "absorbed" else 0
    )
    assert out.dtype == torch.bfloat16
    assert_close("o", ref, out, 2e-2)


def test_mla_split_kv():
    h, rank, rope, nope, vd = 4, 32, 8, 16, 16
    q_lens, ctx = SCENARIOS["decode"]
    page_size = 16
    num_pages = _pages_needed(ctx, page_size)
    torch.manual_seed(4)
    latent = torch.randn(num_pages, page_size, rank + rope, device=DEVICE)
    kv_b = torch.randn(h * (nope + vd), rank, device=DEVICE) * 0.2
    qsl, tables = _batch(q_lens, ctx, page_size, num_pages, seed=4)
    q = torch.randn(qsl[-1], h, nope + rope, device=DEVICE)
    ref = paged_mla_attention(q, latent, qsl, ctx, tables, kv_b, rank, nope, vd, 0.2)
    out = paged_mla_attention_triton(
        q, latent, qsl, ctx, tables, kv_b, rank, nope, vd, 0.2, expand_min_q_len=None, num_splits=4, block_n=16
    )
    assert_close("o", ref, out, tol(torch.float32))


def test_pack_block_tables():
    tables = [torch.tensor([5, 2, 9]), torch.tensor([], dtype=torch.int64), torch.tensor([7])]
    packed = pack_block_tables(tables, DEVICE)
    assert packed.dtype == torch.int32
    assert packed.cpu().tolist() == [[5, 2, 9], [0, 0, 0], [7, 0, 0]]


def test_metadata_rejects_bad_lengths():
    with pytest.raises(ValueError, match="q_len 5"):
        build_attn_meta([5], [3], 1, 16, DEVICE, block_tables=torch.zeros(1, 1, dtype=torch.int32))


def test_wrapper_validates_inputs():
    kv = torch.zeros(4, 8, 2, 2, 16, device=DEVICE)
    q = torch.zeros(3, 4, 16, device=DEVICE)
    tables = [torch.tensor([0, 1])]
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_gqa_attention_triton(q, kv, [0, 2], [9], tables, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        paged_gqa_attention_triton(q[..., :8], kv, [0, 3], [9], tables, 1.0)
