"""kernels/moe/down_norm.py: a one-token MoE's down GEMM with the combine + add + norm in its last program,
against the launches it replaces (``moe_experts_decode`` then ``moe_combine_add_norm``) and the contract
(``naive_moe`` then the add-norm); the ticket across launches and graph replays; the engine's choice of path."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv.naive import add_rms_norm_reference
from kernels.moe.combine_norm import moe_combine_add_norm
from kernels.moe.decode import decode_gemm_tiles, moe_experts_decode
from kernels.moe.down_norm import DOWN_NORM_TICKET_WORDS, moe_experts_decode_add_norm
from kernels.moe.naive import naive_moe, sigmoid_topk_route
from kernels.triton_utils import LaunchTicket
from tests.kernels.helpers import DEVICE, ON_CUDA, assert_close, tol
from tests.kernels.one_row_engine import one_row_launches
from tests.kernels.sm90_compile import compile_errors, ptx_of, record_launches


def _inputs(e: int, k: int, h: int, i: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, h, generator=g).to(DEVICE, dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(DEVICE, dtype)
    w2 = (torch.randn(e, h, i, generator=g) * i**-0.5).to(DEVICE, dtype)
    weights, ids = sigmoid_topk_route(torch.randn(1, e, generator=g).to(DEVICE), None, k, True, 2.446)
    residual = (torch.randn(1, h, generator=g) * 3).to(DEVICE, dtype)
    norm_w = (torch.rand(h, generator=g) + 0.5).to(DEVICE, dtype)
    return x, w13, w2, weights, ids.reshape(-1), residual, norm_w


def _two_launches(x, w13, w2, weights, ids, residual, norm_w, tiles=(None, None)):
    y = moe_experts_decode(x, None, w13, w2, *tiles, ids=ids)
    return moe_combine_add_norm(y, None, weights, residual, norm_w, 1e-6, x.dtype)


@pytest.mark.parametrize("tile_tickets", [False, True], ids=["one-level", "tile-tickets"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("e", "k", "h", "i"), [(12, 9, 256, 64), (16, 4, 96, 80), (8, 8, 64, 32)])
def test_equals_the_two_launches(e, k, h, i, dtype, tile_tickets):
    """The new residual (the combine's bits plus the residual: no reduction across threads) equals the two
    launches' bit for bit; the norm too under the interpreter, and on the GPU to an fp32 rounding of its sum of
    squares, reduced in another thread layout. Every ticket word is back at 0 after each launch."""
    args = _inputs(e, k, h, i, dtype, seed=e + k + h)
    ticket = LaunchTicket(DOWN_NORM_TICKET_WORDS).get(args[0].device)
    want_out, want_res = _two_launches(*args)
    for _ in range(2):  # the second launch finds the ticket put back to 0
        x, w13, w2, weights, ids, residual, norm_w = args
        out, res = moe_experts_decode_add_norm(
            x, w13, w2, ids, weights, residual, norm_w, 1e-6, ticket, tile_tickets=tile_tickets
        )
        assert not ticket.any()
        assert out.dtype == dtype and res.dtype == args[5].dtype
        assert torch.equal(res, want_res)
        if ON_CUDA:
            torch.testing.assert_close(out.float(), want_out.float(), rtol=1e-6 if dtype == torch.float32 else 8e-3,
                                       atol=1e-6 if dtype == torch.float32 else 8e-3)  # fmt: skip
        else:
            assert torch.equal(out, want_out)


@pytest.mark.parametrize("tile_tickets", [False, True], ids=["one-level", "tile-tickets"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_the_contract_with_masked_tails(dtype, tile_tickets):
    """Against the MoE's definition then the add-norm, with the down kernel's own tile: H = 96 over 64 columns
    (a masked tail, in the last column tile's combine too) and the down GEMM's reduction over 5 K steps."""
    x, w13, w2, weights, ids, residual, norm_w = _inputs(16, 9, 96, 80, dtype, seed=6)
    i = w2.shape[2]
    ticket = torch.zeros(3 * 32, dtype=torch.int32, device=DEVICE)  # the launch's line + two column tiles'
    tiles = decode_gemm_tiles(16, 64, 64, 2), decode_gemm_tiles(16, 64, 16, 8)
    out, res = moe_experts_decode_add_norm(
        x, w13, w2, ids, weights, residual, norm_w, 1e-6, ticket, *tiles, tile_tickets=tile_tickets
    )
    assert not ticket.any()
    combined = naive_moe(x.float(), weights, ids.view(1, -1), w13[:, :i].float(), w13[:, i:].float(), w2.float())
    want_out, want_res = add_rms_norm_reference(combined, residual.float(), norm_w.float(), 1e-6)
    loose = tol(dtype) if dtype == torch.float32 else 3e-2
    assert_close("new residual", want_res, res, loose)
    assert_close("norm", want_out, out, loose)
    # each expert's rows count: other experts give another result
    other, _ = moe_experts_decode_add_norm(x, w13, w2, ids.flip(0), weights, residual, norm_w, 1e-6, ticket, *tiles)
    assert not torch.allclose(other.float(), out.float())


def test_bad_inputs_say_what_is_wrong():
    x, w13, w2, weights, ids, residual, norm_w = _inputs(8, 4, 64, 32, torch.float32, seed=1)
    ticket = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="one token"):
        moe_experts_decode_add_norm(x.expand(2, -1), w13, w2, ids, weights, residual, norm_w, 1e-6, ticket)
    with pytest.raises(ValueError, match="int64"):
        moe_experts_decode_add_norm(x, w13, w2, ids.int(), weights, residual, norm_w, 1e-6, ticket)
    with pytest.raises(ValueError, match="residual"):
        moe_experts_decode_add_norm(x, w13, w2, ids, weights, residual[:, :32], norm_w, 1e-6, ticket)
    with pytest.raises(ValueError, match="ticket"):
        moe_experts_decode_add_norm(x, w13, w2, ids, weights, residual, norm_w, 1e-6, ticket.long())
    with pytest.raises(ValueError, match=r"ticket must be a contiguous int32 \[>= 64\]"):  # H 64: one tile
        moe_experts_decode_add_norm(x, w13, w2, ids, weights, residual, norm_w, 1e-6, ticket, tile_tickets=True)
    assert ticket.item() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tile_tickets_equal_the_one_level_tail(dtype):
    """The two tails give the same bits on every backend, the GPU too (there at Kimi's expert shape): each
    column's combine is the same arithmetic, and the norm reduces the same fp32 sums in the same layout."""
    e, k, h, i = (16, 9, 2304, 1024) if ON_CUDA else (12, 9, 200, 48)
    x, w13, w2, weights, ids, residual, norm_w = _inputs(e, k, h, i, dtype, seed=21)
    ticket = LaunchTicket(DOWN_NORM_TICKET_WORDS).get(x.device)
    for _ in range(3):
        one = moe_experts_decode_add_norm(x, w13, w2, ids, weights, residual, norm_w, 1e-6, ticket)
        two = moe_experts_decode_add_norm(x, w13, w2, ids, weights, residual, norm_w, 1e-6, ticket, tile_tickets=True)
        assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
        x = torch.roll(x, 1, dims=1)
    assert not ticket.any()


@pytest.mark.skipif(ON_CUDA, reason="records interpreted launches; on a GPU the tests above run the form itself")
def test_tile_tickets_compile_for_sm90():
    """The two-level tail at Kimi's width in bf16, compiled for sm_90: two more acquire-release atomics (a column
    tile's word, then the launch's) than the one-level form's one."""
    x, w13, w2, weights, ids, residual, norm_w = _inputs(16, 9, 2304, 32, torch.bfloat16, seed=5)
    ticket = LaunchTicket(DOWN_NORM_TICKET_WORDS).get(x.device)
    with record_launches() as seen:
        for tile_tickets in (False, True):
            moe_experts_decode_add_norm(
                x, w13, w2, ids, weights, residual, norm_w, 1e-6, ticket, tile_tickets=tile_tickets
            )
    launches = {dict(x.constexprs).get("TILE_TICKETS"): x for x in seen if x.kernel == "_down_combine_norm_kernel"}
    assert set(launches) == {False, True}
    assert compile_errors(list(launches.values())) == []
    atomics = {k: ptx_of(v).count("atom.global.gpu.acq_rel.add") for k, v in launches.items()}
    assert atomics[True] == atomics[False] + 1 >= 2, atomics


@pytest.mark.skipif(not ON_CUDA, reason="a CUDA graph needs CUDA (the interpreter runs programs one by one)")
@pytest.mark.parametrize("tile_tickets", [False, True], ids=["one-level", "tile-tickets"])
def test_ticket_survives_graph_replays(tile_tickets):
    """Programs really run concurrently here, at Kimi's expert shape (9 experts x 36 column blocks): every replay with
    a new token and new experts equals the two launches, and every ticket word ends at 0."""
    x, w13, w2, weights, ids, residual, norm_w = _inputs(16, 9, 2304, 1024, torch.bfloat16, seed=3)
    ticket = LaunchTicket(DOWN_NORM_TICKET_WORDS).get(x.device)
    kw = dict(tile_tickets=tile_tickets)
    moe_experts_decode_add_norm(x, w13, w2, ids, weights, residual, norm_w, 1e-6, ticket, **kw)  # compile outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res = moe_experts_decode_add_norm(x, w13, w2, ids, weights, residual, norm_w, 1e-6, ticket, **kw)
    gen = torch.Generator().manual_seed(11)
    for _ in range(30):
        x.copy_(torch.randn(x.shape, generator=gen).to(x))
        residual.copy_(torch.randn(residual.shape, generator=gen).to(residual))
        ids.copy_(torch.randperm(16, generator=gen)[:9].to(ids))
        graph.replay()
        want_out, want_res = _two_launches(x, w13, w2, weights, ids, residual, norm_w)
        assert torch.equal(res, want_res)
        torch.testing.assert_close(out.float(), want_out.float(), rtol=8e-3, atol=8e-3)
    assert not ticket.any()


# ---- in the engine ------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("fla_unblocked")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU engine with interpreted kernels")
@pytest.mark.parametrize("down_norm", ["1", "0", "tile-tickets"])
def test_one_token_steps_run_the_combine_in_the_down_launch(tiny_models, monkeypatch, down_norm):
    """Greedy tokens of the tiny Kimi model with the GPU backends, one sequence at a time (every decode step one
    row), weights packed as on CUDA: the reference backends' tokens with the combine + norm in the down launch
    (it ran once per MoE layer a decode step; with the two-level tail too) and in its own launch (it did not)."""
    monkeypatch.setenv("TANDEM_MOE_DOWN_TILE_TICKETS", "1" if down_norm == "tile-tickets" else "0")
    down_norm = "1" if down_norm == "tile-tickets" else down_norm
    monkeypatch.setenv("TANDEM_MOE_DOWN_NORM", down_norm)
    monkeypatch.setenv("TANDEM_MOE_ROUTE_GATE_UP", "0")  # the routing's own launch (with it: test_moe_route_gate_up)
    rows, one_row_blocks = one_row_launches(tiny_models, monkeypatch, ["moe_experts_decode_add_norm"])
    assert len(rows["moe_experts_decode_add_norm"]) == (one_row_blocks if down_norm == "1" else 0)
