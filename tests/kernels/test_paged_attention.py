"""Triton paged attention (GQA and MLA, decode / chunked prefill / mixed) vs kernels/paged_attention/naive.py."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention.meta import build_attn_meta, pack_block_tables, plan_gqa
from kernels.paged_attention.mla import paged_mla_attention_triton, plan_mla, run_mla
from kernels.paged_attention.naive import attention_at_positions, gather_pages, paged_gqa_attention, paged_mla_attention
from kernels.paged_attention.triton import attention_fwd, paged_gqa_attention_triton
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


# ----------------------------------------------------------------------------------------------------------
# Strided query positions (prefill context parallelism): a chunk [start, ctx) of each sequence is striped
# round-robin over `stride` ranks; rank r holds the queries at start + r, start + r + stride, ... and attends
# to the whole cached context. (context_len, chunk start) per sequence: a first chunk, a chunk over a prefix,
# one token (q_len 0 on ranks > 0), two tokens (q_len 0 on rank 2 of 3).
# ----------------------------------------------------------------------------------------------------------
PCP_SEQS = [(70, 0), (40, 29), (9, 8), (17, 15)]
PCP_CTX = [c for c, _ in PCP_SEQS]


def _pcp_rank(stride, rank):
    """One rank's share: q_pos0, q_lens, query_start_loc and its rows in the full (unstriped) chunk batch."""
    q_pos0, q_lens, qsl, rows, full0 = [], [], [0], [], 0
    for ctx, start in PCP_SEQS:
        p0 = start + rank
        ql = max(0, -(-(ctx - p0) // stride))
        q_pos0.append(p0)
        q_lens.append(ql)
        qsl.append(qsl[-1] + ql)
        rows += [full0 + rank + j * stride for j in range(ql)]
        full0 += ctx - start
    return q_pos0, q_lens, qsl, torch.tensor(rows, dtype=torch.int64)


def _positions(q_pos0, q_lens, stride):
    return [torch.arange(ql) * stride + p0 for p0, ql in zip(q_pos0, q_lens, strict=True)]


def _gqa_at_positions(q, kv, qsl, ctx_lens, tables, positions, scale):
    """Reference: per sequence, the whole context's K/V gathered from the pages, queries at ``positions``."""
    out = torch.empty_like(q)
    rep = q.shape[1] // kv.shape[3]
    for i, ctx in enumerate(ctx_lens):
        s, e = qsl[i], qsl[i + 1]
        kv_i = gather_pages(kv, tables[i], ctx)
        k, v = kv_i[:, 0].repeat_interleave(rep, dim=1), kv_i[:, 1].repeat_interleave(rep, dim=1)
        out[s:e] = attention_at_positions(q[s:e], k, v, positions[i], scale)
    return out


def _mla_at_positions(q, latent, qsl, ctx_lens, tables, positions, kv_b, rank, nope, vd, scale):
    """Reference: naive.paged_mla_attention's expanded form with queries at ``positions``."""
    h = q.shape[1]
    out = q.new_empty(q.shape[0], h, vd)
    for i, ctx in enumerate(ctx_lens):
        s, e = qsl[i], qsl[i + 1]
        lat = gather_pages(latent, tables[i], ctx)
        kv = torch.nn.functional.linear(lat[:, :rank], kv_b).view(ctx, h, nope + vd)
        k = torch.cat([kv[..., :nope], lat[:, None, rank:].expand(ctx, h, lat.shape[1] - rank)], dim=-1)
        out[s:e] = attention_at_positions(q[s:e], k, kv[..., nope:], positions[i], scale)
    return out


def _pcp_gqa_setup(seed):
    page_size, hq, hkv, d = 4, 4, 2, 32  # group 2, small pages
    num_pages = _pages_needed(PCP_CTX, page_size)
    torch.manual_seed(seed)
    kv = torch.randn(num_pages, page_size, 2, hkv, d, device=DEVICE)
    qsl_full, tables = _batch([c - s for c, s in PCP_SEQS], PCP_CTX, page_size, num_pages, seed=seed)
    q_full = torch.randn(qsl_full[-1], hq, d, device=DEVICE)
    return kv, tables, qsl_full, q_full, hq // hkv, d**-0.5


@pytest.mark.parametrize("stride", [2, 3])
def test_gqa_strided_positions(stride):
    """Every rank against the reference at its positions; the ranks together give the unstriped chunk's output."""
    kv, tables, qsl_full, q_full, group, scale = _pcp_gqa_setup(5)
    bt = pack_block_tables(tables, DEVICE)
    out_full = torch.full_like(q_full, float("nan"))
    for rank in range(stride):
        q_pos0, q_lens, qsl, rows = _pcp_rank(stride, rank)
        q = q_full[rows.to(DEVICE)]
        meta = plan_gqa(qsl, PCP_CTX, bt, group, DEVICE, q.shape[-1], q_pos0=q_pos0, pos_stride=stride)
        assert meta.pos_stride == stride and meta.qpos0.cpu().tolist() == q_pos0
        out = attention_fwd(q, kv[:, :, 0], kv[:, :, 1], meta, scale)
        ref = _gqa_at_positions(q, kv, qsl, PCP_CTX, tables, _positions(q_pos0, q_lens, stride), scale)
        assert_close(f"rank {rank}/{stride}", ref, out, tol(torch.float32))
        out_full[rows.to(DEVICE)] = out
    ref_full = paged_gqa_attention(q_full, kv, qsl_full, PCP_CTX, tables, scale)
    assert_close("all ranks", ref_full, out_full, tol(torch.float32))


@pytest.mark.parametrize(("stride", "rank"), [(2, 1), (3, 0)])
def test_gqa_strided_positions_split_kv(stride, rank):
    """Forced split-KV: parts past a block's last position are empty (lse -inf) and drop out of the merge."""
    kv, tables, _, q_full, group, scale = _pcp_gqa_setup(6)
    q_pos0, q_lens, qsl, rows = _pcp_rank(stride, rank)
    q = q_full[rows.to(DEVICE)]
    meta = plan_gqa(
        qsl, PCP_CTX, pack_block_tables(tables, DEVICE), group, DEVICE, 32, q_pos0=q_pos0, pos_stride=stride
    )
    out = attention_fwd(q, kv[:, :, 0], kv[:, :, 1], meta, scale, num_splits=2, block_n=16)
    ref = _gqa_at_positions(q, kv, qsl, PCP_CTX, tables, _positions(q_pos0, q_lens, stride), scale)
    assert_close("o", ref, out, tol(torch.float32))


def test_gqa_explicit_last_positions_match_default():
    """q_pos0 = ctx - q_len with stride 1 is the default contract: same output, bit for bit."""
    q_lens, ctx = SCENARIOS["mixed"]
    page_size, hq, hkv, d = 8, 4, 2, 32
    num_pages = _pages_needed(ctx, page_size)
    torch.manual_seed(7)
    kv = torch.randn(num_pages, page_size, 2, hkv, d, device=DEVICE)
    qsl, tables = _batch(q_lens, ctx, page_size, num_pages, seed=7)
    q = torch.randn(qsl[-1], hq, d, device=DEVICE)
    bt = pack_block_tables(tables, DEVICE)
    default = plan_gqa(qsl, ctx, bt, 2, DEVICE, d)
    explicit = plan_gqa(qsl, ctx, bt, 2, DEVICE, d, q_pos0=[c - ql for c, ql in zip(ctx, q_lens, strict=True)])
    assert default.qpos0 is None and default.pos_stride == 1
    assert torch.equal(default.work, explicit.work)
    out_default = attention_fwd(q, kv[:, :, 0], kv[:, :, 1], default, 0.2)
    out_explicit = attention_fwd(q, kv[:, :, 0], kv[:, :, 1], explicit, 0.2)
    assert torch.equal(out_default, out_explicit)


@pytest.mark.parametrize(
    ("form", "stride", "rank"),
    [("absorbed", 2, 1), ("absorbed", 3, 0), ("expanded", 3, 2), ("mixed", 2, 1)],
)
def test_mla_strided_positions(form, stride, rank):
    """plan_mla + run_mla; "mixed": the longer chunks expanded, the others absorbed (each part gets its own
    sequences' q_pos0)."""
    h, rank_dim, rope, nope, vd = (MLA_DIMS["tiny4L"][k] for k in ("h", "rank", "rope", "nope", "v"))
    page_size = 8
    num_pages = _pages_needed(PCP_CTX, page_size)
    torch.manual_seed(8)
    latent = torch.randn(num_pages, page_size, rank_dim + rope, device=DEVICE)
    kv_b = torch.randn(h * (nope + vd), rank_dim, device=DEVICE) * rank_dim**-0.5
    q_pos0, q_lens, qsl, _ = _pcp_rank(stride, rank)
    _, tables = _batch(q_lens, PCP_CTX, page_size, num_pages, seed=8)
    q = torch.randn(qsl[-1], h, nope + rope, device=DEVICE)
    scale = (nope + rope) ** -0.5
    threshold = {"absorbed": None, "expanded": 0, "mixed": 4}[form]
    bt = pack_block_tables(tables, DEVICE)
    parts = plan_mla(qsl, PCP_CTX, bt, h, page_size, rank_dim, DEVICE, threshold, q_pos0=q_pos0, pos_stride=stride)
    assert [p.expanded for p in parts] == {"absorbed": [False], "expanded": [True], "mixed": [False, True]}[form]
    out = run_mla(q, latent, parts, kv_b, rank_dim, nope, vd, scale)
    positions = _positions(q_pos0, q_lens, stride)
    ref = _mla_at_positions(q, latent, qsl, PCP_CTX, tables, positions, kv_b, rank_dim, nope, vd, scale)
    assert_close("o", ref, out, tol(torch.float32))


def test_strided_metadata():
    """The work list is sorted by the real last position + 1; q_pos0 rides in the single int32 copy."""
    bt = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    default = build_attn_meta([4, 4], [100, 50], 1, 16, DEVICE, block_tables=bt)
    assert default.work[:, 0].cpu().tolist() == [0, 1] and default.qpos0 is None
    meta = build_attn_meta([4, 4], [100, 50], 1, 16, DEVICE, block_tables=bt, q_pos0=[0, 3], pos_stride=10)
    assert meta.work[:, 0].cpu().tolist() == [1, 0]  # keys 3 + 3 * 10 + 1 = 34 > 0 + 3 * 10 + 1 = 31
    assert meta.qpos0.cpu().tolist() == [0, 3] and meta.qpos0.dtype == torch.int32 and meta.pos_stride == 10
    contig = build_attn_meta([4, 0], [100, 50], 1, 16, DEVICE, kv_start=[0, 100], q_pos0=[96, 50])
    assert contig.kv_start.cpu().tolist() == [0, 100] and contig.qpos0.cpu().tolist() == [96, 50]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(q_pos0=[0]), "1 q_pos0 but 2"),
        (dict(q_pos0=[0, 0], pos_stride=0), "pos_stride must be >= 1"),
        (dict(pos_stride=2), "needs q_pos0"),
        (dict(q_pos0=[0, -1]), "q_pos0 -1 must be >= 0"),
        (dict(q_pos0=[0, 1], pos_stride=3), "= 10 must be < context_len 10"),  # 1 + 3 * 3
        (dict(q_pos0=[7, 7]), "= 10 must be < context_len 10"),  # stride 1: 7 + 3 past the end
    ],
)
def test_strided_metadata_rejects_bad_positions(kwargs, match):
    bt = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        build_attn_meta([2, 4], [20, 10], 1, 16, DEVICE, block_tables=bt, **kwargs)
