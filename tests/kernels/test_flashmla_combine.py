"""kernels/flashmla/combine.py: Tandem's split-KV combine against its contract (naive_combine.py), the contract
against softmax attention over all keys, and, on an sm90 GPU with FlashMLA built, FlashMLA's split kernel with
this combine against FlashMLA's own combine and the fp32 reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels.flashmla.build import missing_sources, source_dir
from kernels.flashmla.combine import split_combine
from kernels.flashmla.naive_combine import naive_split_combine
from tests.kernels.helpers import DEVICE

ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
SENTINEL = 7.0  # rows the combine must leave alone (one-split requests: the split kernel wrote them)


def _splits(counts: list[int], h: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random accumulators for requests with these split counts, plus 3 spare rows as the split kernel allocates
    (B + parts rows, not all used)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(counts) + 3
    o_accum = torch.randn(total, h, d, generator=g)
    lse_accum = torch.randn(total, h, generator=g) * 4 + 3
    cum = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    return o_accum.to(DEVICE), lse_accum.to(DEVICE), cum.to(DEVICE)


@pytest.mark.parametrize(
    ("counts", "h", "d", "block_d", "split_block"),
    [
        ([1, 2, 5, 1, 33], 3, 64, 32, 8),  # one-split requests between others, a count past several chunks
        ([130], 2, 64, 64, 32),  # one request over a 132-part grid's worth of splits
        ([4, 64], 4, 512, 128, 32),  # the real head dim, in 4 slices
        ([1], 2, 64, 64, 32),  # nothing to combine
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_matches_the_contract(counts, h, d, block_d, split_block, dtype):
    o_accum, lse_accum, cum = _splits(counts, h, d, seed=len(counts) + d)
    out = torch.full((len(counts), h, d), SENTINEL, device=DEVICE).to(dtype)
    want = naive_split_combine(o_accum.cpu(), lse_accum.cpu(), cum.cpu(), out.cpu().clone())
    got = split_combine(o_accum, lse_accum, cum, out, max(counts) + 2, block_d=block_d, split_block=split_block)
    assert got is out
    for r, n in enumerate(counts):
        if n == 1:
            assert (out[r].float() == SENTINEL).all(), f"request {r} has one split: its rows must be untouched"
        elif dtype == torch.float32:
            torch.testing.assert_close(out[r].cpu(), want[r], rtol=1e-5, atol=1e-6)
        else:  # a bf16 rounding apart at most: the sums run in another order
            torch.testing.assert_close(out[r].float().cpu(), want[r].float(), rtol=8e-3, atol=1e-3)


def test_requests_without_keys_get_zeros():
    """All of a request's splits -inf (no keys, as the split kernel writes for an empty split): zeros, as FlashMLA's
    combine writes (its global lse is +inf, every weight 0); the other request is unaffected."""
    o_accum, lse_accum, cum = _splits([3, 2], 2, 32, seed=1)
    lse_accum[:3] = -torch.inf
    lse_accum[3] = -torch.inf  # one of two splits empty: the other one's output alone
    out = torch.full((2, 2, 32), SENTINEL, device=DEVICE)
    split_combine(o_accum, lse_accum, cum, out, 4, block_d=32)
    assert (out[0] == 0).all()
    torch.testing.assert_close(out[1], o_accum[4], rtol=1e-6, atol=1e-6)
    want = naive_split_combine(o_accum.cpu(), lse_accum.cpu(), cum.cpu(), torch.zeros(2, 2, 32))
    torch.testing.assert_close(out.cpu(), want)


def test_the_contract_is_softmax_over_all_keys():
    """Splitting keys into ranges, each split's normalised output and base-2 log-sum as FlashMLA's split kernel
    leaves them, then combining: the same as softmax attention over all keys at once."""
    g = torch.Generator().manual_seed(4)
    h, d, n_keys = 3, 16, 50
    q, k, v = torch.randn(h, d, generator=g), torch.randn(n_keys, d, generator=g), torch.randn(n_keys, d, generator=g)
    s = (q @ k.T).double()  # [h, n]
    full = torch.softmax(s, dim=-1) @ v.double()
    bounds = [0, 7, 8, 30, 50]
    o_acc, lse_acc = [], []
    for lo, hi in itertools.pairwise(bounds):
        part = s[:, lo:hi]
        o_acc.append(torch.softmax(part, dim=-1) @ v[lo:hi].double())
        lse_acc.append(torch.logsumexp(part, dim=-1) / torch.log(torch.tensor(2.0, dtype=torch.float64)))
    o_accum = torch.stack(o_acc).float()
    lse_accum = torch.stack(lse_acc).float()
    cum = torch.tensor([0, len(o_acc)], dtype=torch.int32)
    got = naive_split_combine(o_accum, lse_accum, cum, torch.zeros(1, h, d))
    torch.testing.assert_close(got[0].double(), full, rtol=1e-5, atol=1e-6)
    kernel = split_combine(
        o_accum.to(DEVICE), lse_accum.to(DEVICE), cum.to(DEVICE), torch.zeros(1, h, d, device=DEVICE), 4
    )
    torch.testing.assert_close(kernel[0].double().cpu(), full, rtol=1e-5, atol=1e-6)


def test_bad_arguments_say_what_is_wrong():
    o_accum, lse_accum, cum = _splits([2, 3], 2, 32, seed=2)
    out = torch.zeros(2, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="fp32"):
        split_combine(o_accum.half(), lse_accum, cum, out, 4)
    with pytest.raises(ValueError, match="must be"):
        split_combine(o_accum[:, :1], lse_accum, cum, out, 4)
    with pytest.raises(ValueError, match="num_splits must be int32"):
        split_combine(o_accum, lse_accum, cum.long(), out, 4)
    with pytest.raises(ValueError, match="num_splits must be int32"):
        split_combine(o_accum, lse_accum, cum[:2], out, 4)
    with pytest.raises(ValueError, match="unit stride"):
        split_combine(o_accum.transpose(1, 2).contiguous().transpose(1, 2), lse_accum, cum, out, 4)
    with pytest.raises(ValueError, match="powers of 2"):
        split_combine(o_accum, lse_accum, cum, out, 4, block_d=48)
    with pytest.raises(ValueError, match="max_splits"):
        split_combine(o_accum, lse_accum, cum, out, 0)


def test_combine_choice_comes_from_the_environment(monkeypatch):
    """TANDEM_FLASHMLA_COMBINE: auto takes Triton's up to TRITON_COMBINE_MAX_BATCH where the extension binds the
    split kernel alone and Tandem planned; triton takes it at any batch and raises where it cannot run (naming why);
    flashmla never takes it; other values raise."""
    from types import SimpleNamespace

    import kernels.flashmla.decode as decode

    new, old = SimpleNamespace(dense_decode_split_fwd=None), SimpleNamespace()
    small, large = 1, decode.TRITON_COMBINE_MAX_BATCH + 1
    monkeypatch.delenv(decode.COMBINE_ENV, raising=False)
    assert decode.combine_impl() == "auto"
    assert decode._triton_combine(new, True, small) and decode._triton_combine(new, True, large - 1)
    assert not decode._triton_combine(new, True, large)
    assert not decode._triton_combine(new, False, small) and not decode._triton_combine(old, True, small)
    monkeypatch.setenv(decode.COMBINE_ENV, "flashmla")
    assert not decode._triton_combine(new, True, small)
    monkeypatch.setenv(decode.COMBINE_ENV, "triton")
    assert decode._triton_combine(new, True, small) and decode._triton_combine(new, True, large)
    with pytest.raises(ValueError, match="rebuild"):
        decode._triton_combine(old, True, small)
    with pytest.raises(ValueError, match="plans itself"):
        decode._triton_combine(new, False, small)
    monkeypatch.setenv(decode.COMBINE_ENV, "cuda")
    with pytest.raises(ValueError, match=decode.COMBINE_ENV):
        decode.combine_impl()


@pytest.mark.skipif(
    not ON_SM90 or bool(missing_sources(source_dir())),
    reason="needs an sm90 GPU and the FlashMLA sources (kernels/flashmla/fetch_sources.sh); CI has neither",
)
@pytest.mark.parametrize("ctx", [[4096], [32768], [1, 63, 64, 65, 1000, 4097], [100] * 16])
def test_split_kernel_with_this_combine_matches_flashmla_on_sm90(monkeypatch, ctx):
    """The split kernel alone + this combine vs FlashMLA's own combine (a bf16 rounding apart) and vs the fp32
    reference, with Tandem's plans at several part counts (1 x 32k: 64 and 132 parts)."""
    from kernels.flashmla.decode import flashmla_decode_fwd
    from tests.kernels.test_mla_decode import _reference, _setup

    q_lat, q_pe, latent, tables, bt, ctx_t = _setup(ctx, 32, 512, 64, 64, dtype=torch.bfloat16)
    scale = 192**-0.5
    ref = _reference(q_lat, q_pe, latent, tables, ctx, scale)
    for parts in (None, 132):
        outs = {}
        for impl in ("flashmla", "triton"):  # forced: the Triton combine at every batch here
            monkeypatch.setenv("TANDEM_FLASHMLA_COMBINE", impl)
            outs[impl] = flashmla_decode_fwd(q_lat, q_pe, latent, bt, ctx_t, scale, num_parts=parts).float()
        assert (outs["triton"] - outs["flashmla"]).abs().max().item() < 1e-2, (ctx, parts)
        assert (outs["triton"].cpu() - ref).abs().max().item() < 2e-2, (ctx, parts)
