"""MoE: Triton sigmoid top-k routing and grouped-GEMM experts vs kernels/moe/naive.py."""

from __future__ import annotations

import pytest
import torch

from kernels.moe.align import moe_align_blocks, moe_align_triton
from kernels.moe.combine import moe_combine_triton
from kernels.moe.decode import (
    decode_gemm_tiles,
    decode_tiles,
    down_norm_tiles,
    moe_experts_decode,
    parse_one_row_tiles,
)
from kernels.moe.grouped import grouped_moe, moe_align, moe_combine
from kernels.moe.naive import naive_moe, sigmoid_topk_route
from kernels.moe.triton import sigmoid_topk_route_triton
from tests.kernels.helpers import DEVICE, assert_close, tol


def _sorted_by_id(weights, ids):
    ids_sorted, order = ids.sort(dim=1)
    return weights.gather(1, order), ids_sorted


@pytest.mark.parametrize("logit_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("t", "e", "k", "bias", "renorm", "scale"),
    [
        (37, 256, 8, True, True, 2.446),  # Kimi-Linear's router
        (5, 4, 2, True, True, 2.446),  # tiny-4L
        (19, 20, 3, False, False, 1.0),  # non-power-of-2 experts, no bias, no renormalisation
        (1, 64, 64, True, True, 1.0),  # k == E
    ],
)
def test_route(t, e, k, bias, renorm, scale, logit_dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(t, e, generator=g) * 2).to(DEVICE, logit_dtype)
    b = (torch.randn(e, generator=g) * 0.1).to(DEVICE) if bias else None
    ref_w, ref_ids = _sorted_by_id(*sigmoid_topk_route(logits, b, k, renorm, scale))
    w, ids = sigmoid_topk_route_triton(logits, b, k, renorm, scale)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    w, ids = _sorted_by_id(w, ids)
    assert torch.equal(ids, ref_ids)
    assert_close("weights", ref_w, w, 1e-6)


def test_route_picks_by_biased_score_weights_by_unbiased():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]], device=DEVICE)
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0], device=DEVICE)
    w, ids = sigmoid_topk_route_triton(logits, bias, 2, False, 1.0)
    assert sorted(ids[0].tolist()) == [0, 3]
    assert_close("w", torch.sigmoid(logits[0, [0, 3]]).sort()[0], w[0].sort()[0], 1e-6)


def test_align_groups_pairs_by_expert():
    ids = torch.tensor([[2, 0], [1, 2], [2, 1]], device=DEVICE)
    al = moe_align(ids, 4)
    assert al.offsets.tolist() == [1, 3, 6, 6]
    assert ids.reshape(-1)[al.order].tolist() == [0, 1, 1, 2, 2, 2]
    assert al.token.tolist() == (al.order // 2).tolist()


def _routed_ids(t: int, e: int, k: int, hot: int | None) -> torch.Tensor:
    """[t, k] expert ids: k distinct experts a token, or (hot) most pairs on the first ``hot`` experts."""
    g = torch.Generator().manual_seed(t + e)
    if hot is None:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    else:
        ids = torch.randint(0, hot, (t, k), generator=g)
        ids[::5] = torch.randint(0, e, (len(ids[::5]), k), generator=g)
    return ids.to(DEVICE)


@pytest.mark.parametrize(
    ("t", "e", "k", "hot"),
    [
        (64, 256, 8, None),  # a decode batch of Kimi-Linear: 512 pairs, 8 blocks
        (1, 256, 8, None),
        (37, 20, 3, None),  # non-power-of-2 experts, a partial last block
        (50, 16, 4, 2),  # most pairs on two experts: long runs of equal ids inside and across blocks
        (300, 64, 8, 3),  # 2,400 pairs: the by-expert kernel's loads span three 1,024-id blocks
    ],
)
def test_moe_align_triton_is_the_stable_sort(t, e, k, hot):
    ids = _routed_ids(t, e, k, hot)
    want, got = moe_align(ids, e), moe_align_triton(ids, e)
    assert got.offsets.tolist() == want.offsets.tolist()
    assert got.order.tolist() == want.order.tolist()
    assert got.token.tolist() == want.token.tolist()
    rows = got.rows_of_pairs()  # the kernel's own inverse of the order
    assert got.position is not None and rows.tolist() == want.rows_of_pairs().tolist()
    assert torch.equal(got.order[rows], torch.arange(t * k, device=DEVICE))


SLOW_SORT = "the interpreter sorts a 2,048-key block in ~4 s (32 of them here); the host runs smaller blocks"


@pytest.mark.parametrize(
    ("t", "e", "k", "hot", "block"),
    [
        pytest.param(  # an 8k prefill of Kimi-Linear with the default block: 65,536 pairs, 32 blocks
            8192, 256, 8, None, 2048, marks=pytest.mark.skipif(DEVICE.type != "cuda", reason=SLOW_SORT)
        ),
        (512, 256, 8, None, 512),  # Kimi's experts, 8 blocks
        (400, 64, 6, None, 256),  # a partial last block
        (300, 16, 4, 2, 64),  # most pairs on two experts: runs of one expert across many blocks
        (3, 8, 2, None, 64),  # fewer pairs than a block
    ],
)
def test_moe_align_blocks_is_the_stable_sort(t, e, k, hot, block):
    ids = _routed_ids(t, e, k, hot)
    want, got = moe_align(ids, e), moe_align_blocks(ids, e, block=block)
    assert got.offsets.dtype == torch.int32 and got.offsets.tolist() == want.offsets.tolist()
    assert got.order.tolist() == want.order.tolist()
    assert got.token.tolist() == want.token.tolist()
    assert got.position is not None and got.rows_of_pairs().tolist() == want.rows_of_pairs().tolist()
    with pytest.raises(ValueError, match="powers of two"):
        moe_align_blocks(ids, e, block=block + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("t", "k", "h"), [(1, 8, 64), (37, 3, 200), (5, 2, 2304)])
def test_combine_triton_matches_torch_and_the_definition(t, k, h, dtype):
    g = torch.Generator().manual_seed(t * k)
    y = torch.randn(t * k, h, generator=g).to(DEVICE, dtype)
    rows = torch.randperm(t * k, generator=g).to(DEVICE)
    weights = torch.rand(t, k, generator=g).to(DEVICE)
    want = torch.stack([sum(weights[i, s] * y[rows[i * k + s]].float() for s in range(k)) for i in range(t)])
    ref, got = moe_combine(y, rows, weights, dtype), moe_combine_triton(y, rows, weights, dtype)
    assert got.dtype == ref.dtype == dtype
    assert_close("torch combine", want, ref.float(), tol(dtype) if dtype == torch.float32 else 1e-2)
    assert_close("triton combine", ref.float(), got.float(), tol(dtype) if dtype == torch.float32 else 1e-2)
    if t > 1:  # a row of another token changes the result: the test sees the gather
        swapped = rows.clone()
        swapped[[0, k]] = swapped[[k, 0]]
        assert not torch.allclose(moe_combine_triton(y, swapped, weights, dtype).float(), got.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_combine_adds_the_shared_output_bit_for_bit_as_a_separate_add(dtype):
    """``add`` (the shared expert) folded into the combine: the sum rounded to the output dtype, then added and
    rounded again, so the result equals ``combine(...) + add`` exactly, in both implementations."""
    t, k, h = 37, 3, 200
    g = torch.Generator().manual_seed(4)
    y = torch.randn(t * k, h, generator=g).to(DEVICE, dtype)
    rows = torch.randperm(t * k, generator=g).to(DEVICE)
    weights = torch.rand(t, k, generator=g).to(DEVICE)
    add = torch.randn(t, h + 8, generator=g).to(DEVICE, dtype)[:, 3 : 3 + h]  # a strided view
    want = moe_combine_triton(y, rows, weights, dtype) + add
    got = moe_combine_triton(y, rows, weights, dtype, add)
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":  # the interpreter's fp32 -> bf16 casts truncate
        assert_close("combine + add", want.float(), got.float(), 1e-2)
    else:
        assert torch.equal(got, want)
    assert torch.equal(moe_combine(y, rows, weights, dtype, add), moe_combine(y, rows, weights, dtype) + add)
    ref = moe_combine(y, rows, weights, dtype, add)  # the torch reference, independently of the kernel
    assert_close("combine + add vs torch", ref.float(), got.float(), tol(dtype) if dtype == torch.float32 else 1e-2)
    with pytest.raises(ValueError, match="add must be"):
        moe_combine_triton(y, rows, weights, dtype, add[:-1])


@pytest.mark.parametrize("packed", [False, True], ids=["w1_w3", "w13"])
@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("t", "e", "k", "h", "i"), [(1, 8, 2, 64, 32), (29, 16, 4, 64, 32), (64, 4, 2, 128, 64)])
def test_experts(t, e, k, h, i, dtype, impl, packed):
    if impl == "grouped_mm" and dtype == torch.float32 and DEVICE.type == "cuda":
        pytest.skip("CUDA grouped_mm is bf16-only by design; the auto path uses the loop for fp32")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, h, generator=g).to(DEVICE, dtype)
    w1, w3 = (torch.randn(e, i, h, generator=g) * h**-0.5 for _ in range(2))
    w2 = torch.randn(e, h, i, generator=g) * i**-0.5
    w1, w3, w2 = (w.to(DEVICE, dtype) for w in (w1, w3, w2))
    weights, ids = sigmoid_topk_route(torch.randn(t, e, generator=g).to(DEVICE), None, k, True, 2.446)
    ref = naive_moe(x.float(), weights, ids, w1.float(), w3.float(), w2.float())
    w13 = None
    if packed:  # gate | up in one tensor, w1 / w3 its views (SparseMoE.pack_weights)
        w13 = torch.cat([w1, w3], dim=1)
        w1, w3 = w13[:, :i], w13[:, i:]
    for combine in (None, moe_combine_triton):
        out = grouped_moe(x, weights, ids, w1, w3, w2, impl=impl, w13=w13, combine=combine)
        assert out.dtype == dtype
        assert_close("y", ref, out, tol(dtype) if dtype == torch.float32 else 1.5e-2)


def test_experts_rejects_bad_shapes():
    x = torch.zeros(3, 8, device=DEVICE)
    w = torch.zeros(2, 4, 8, device=DEVICE)
    ids = torch.zeros(3, 1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="w2"):
        grouped_moe(x, ids.float(), ids, w, w, w)
    with pytest.raises(ValueError, match="impl"):
        grouped_moe(x, ids.float(), ids, w, w, w.transpose(1, 2), impl="magic")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("t", "e", "k", "h", "i", "blocks"),
    [
        (1, 8, 2, 64, 32, (16, 16, 32)),  # one token: most experts' programs return at once
        (29, 16, 4, 96, 48, (16, 32, 64)),  # H and I not multiples of the blocks: masked tails
        (40, 4, 2, 64, 32, (16, 16, 16)),  # groups longer than BLOCK_M: several row chunks per program
        (70, 4, 2, 96, 80, (None, None, None)),  # the default tiles above 16 tokens (decode_tiles: 32 x 64)
        (3, 32, 4, 64, 32, (16, 16, 32)),  # fewer pairs (12) than experts: the grid runs over pairs (ids given)
        (5, 16, 3, 64, 48, (None, None, None)),  # 15 pairs over 16 experts, some repeated: one program an expert
    ],
)
@pytest.mark.parametrize("with_ids", [False, True], ids=["expert_grid", "pair_grid"])
def test_decode_experts_match_the_definition(t, e, k, h, i, blocks, dtype, with_ids):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(t, h, generator=g).to(DEVICE, dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(DEVICE, dtype)
    w2 = (torch.randn(e, h, i, generator=g) * i**-0.5).to(DEVICE, dtype)
    weights, ids = sigmoid_topk_route(torch.randn(t, e, generator=g).to(DEVICE), None, k, True, 2.446)
    ref = naive_moe(x.float(), weights, ids, w13[:, :i].float(), w13[:, i:].float(), w2.float())
    al = moe_align_triton(ids, e)
    bm, bn, bk = blocks
    flat = ids.reshape(-1) if with_ids else None
    tiles = None if bm is None else decode_gemm_tiles(bm, bn, bk)
    y = moe_experts_decode(x, al, w13, w2, tiles, tiles, ids=flat)
    assert y.shape == (t * k, h) and y.dtype == dtype
    out = moe_combine_triton(y, al.rows_of_pairs(), weights, dtype)
    assert_close("decode experts", ref, out, tol(dtype) if dtype == torch.float32 else 1.5e-2)
    # each sorted row is its own expert's output: rows of another expert's group differ
    if e > 1 and al.offsets[0] > 0 and al.offsets[-1] > al.offsets[0]:
        wrong = moe_experts_decode(x, al, w13.flip(0), w2.flip(0), ids=flat)  # experts swapped: another result
        assert not torch.allclose(wrong.float(), y.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("e", "k", "h", "i"), [(8, 2, 64, 32), (32, 9, 96, 48), (16, 16, 64, 80)])
def test_pair_rows_equal_the_sorted_layout_for_one_token(e, k, h, i, dtype):
    """One token's experts are distinct: pair s as row s (no align launch) gives the sorted layout's rows, bit
    for bit, in pair order, and the combine over them in pair order the same output."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, h, generator=g).to(DEVICE, dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(DEVICE, dtype)
    w2 = (torch.randn(e, h, i, generator=g) * i**-0.5).to(DEVICE, dtype)
    weights, ids = sigmoid_topk_route(torch.randn(1, e, generator=g).to(DEVICE), None, k, True, 2.446)
    flat = ids.reshape(-1)
    al = moe_align_triton(ids, e)
    sorted_rows = moe_experts_decode(x, al, w13, w2, ids=flat)
    pair_rows = moe_experts_decode(x, None, w13, w2, ids=flat)
    assert torch.equal(pair_rows, sorted_rows[al.rows_of_pairs()])
    out = moe_combine_triton(pair_rows, None, weights, dtype)
    assert torch.equal(out, moe_combine_triton(sorted_rows, al.rows_of_pairs(), weights, dtype))
    rows = al.rows_of_pairs()
    assert torch.equal(moe_combine(pair_rows, None, weights, dtype), moe_combine(sorted_rows, rows, weights, dtype))
    ref = naive_moe(x.float(), weights, ids, w13[:, :i].float(), w13[:, i:].float(), w2.float())
    assert_close("pair rows", ref, out, tol(dtype) if dtype == torch.float32 else 1.5e-2)
    # each row is its own pair's expert: another expert order gives other rows
    assert not torch.allclose(moe_experts_decode(x, None, w13, w2, ids=flat.flip(0)).float(), pair_rows.float())


def test_pair_rows_refuse_more_than_one_token():
    x = torch.zeros(2, 64, device=DEVICE)
    w13, w2 = torch.zeros(4, 64, 64, device=DEVICE), torch.zeros(4, 64, 32, device=DEVICE)
    with pytest.raises(ValueError, match="one token"):
        moe_experts_decode(x, None, w13, w2, ids=torch.zeros(4, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="one token"):
        moe_experts_decode(x[:1], None, w13, w2)


def test_decode_tiles_take_two_row_blocks_only_above_16_tokens():
    """Up to 16 tokens no expert has more than 16 rows (one block, 32 columns); above, 32 x 64 tiles. One token's
    down launch with the combine + norm in it: 64 columns (its ticket costs less in fewer programs)."""
    got = [(gu.block_m, gu.block_n, dn.block_n) for gu, dn in map(decode_tiles, (1, 16, 17, 64))]
    assert got == [(16, 32, 32), (16, 32, 32), (32, 64, 64), (32, 64, 64)]
    assert down_norm_tiles() == decode_gemm_tiles(16, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pair_rows_with_separate_kernel_tiles_match_the_definition(dtype):
    """One token, the gate-up and down kernels launched with different tiles (``TANDEM_MOE_ONE_ROW_TILES``):
    masked column tails in both (I = 80 over 64 columns, H = 96 over 64), the reduction over 2 and 5 K steps."""
    g = torch.Generator().manual_seed(6)
    e, k, h, i = 16, 9, 96, 80
    x = torch.randn(1, h, generator=g).to(DEVICE, dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(DEVICE, dtype)
    w2 = (torch.randn(e, h, i, generator=g) * i**-0.5).to(DEVICE, dtype)
    weights, ids = sigmoid_topk_route(torch.randn(1, e, generator=g).to(DEVICE), None, k, True, 2.446)
    ref = naive_moe(x.float(), weights, ids, w13[:, :i].float(), w13[:, i:].float(), w2.float())
    gate_up, down = decode_gemm_tiles(16, 64, 64, 2), decode_gemm_tiles(16, 64, 16, 8)
    y = moe_experts_decode(x, None, w13, w2, gate_up, down, ids=ids.reshape(-1))
    out = moe_combine_triton(y, None, weights, dtype)
    assert_close("pair rows, own tiles", ref, out, tol(dtype) if dtype == torch.float32 else 1.5e-2)


def test_one_row_tiles_parse_and_refuse_bad_text(monkeypatch):
    want = (decode_gemm_tiles(16, 64, 256, 4), decode_gemm_tiles(16, 16, 512, 8))
    assert parse_one_row_tiles("64/256/4,16/512/8") == want
    for bad in ("64/256/4", "64/256,16/512/8", "48/256/4,16/512/8", "a/b/c,1/2/3", "8/256/4,16/512/8"):
        with pytest.raises(ValueError, match="TANDEM_MOE_ONE_ROW_TILES"):
            parse_one_row_tiles(bad)
    from kernels.moe import decode

    monkeypatch.setenv("TANDEM_MOE_ONE_ROW_TILES", "64/256/4,16/512/8")
    decode.one_row_tiles_override.cache_clear()
    try:
        assert decode_tiles(1) == want and decode_tiles(2) == (decode_gemm_tiles(16, 32),) * 2
        assert down_norm_tiles() == want[1]
    finally:
        monkeypatch.delenv("TANDEM_MOE_ONE_ROW_TILES")
        decode.one_row_tiles_override.cache_clear()
    assert decode_tiles(1) == (decode_gemm_tiles(16, 32),) * 2


def test_decode_experts_refuse_bad_shapes():
    x = torch.zeros(2, 64, device=DEVICE)
    al = moe_align_triton(torch.zeros(2, 1, dtype=torch.int64, device=DEVICE), 4)
    with pytest.raises(ValueError, match="w2"):
        moe_experts_decode(x, al, torch.zeros(4, 64, 64, device=DEVICE), torch.zeros(4, 64, 16, device=DEVICE))
