"""kernels/sampling/triton.py (the greedy ids of a logits batch in two launches, or one with a ticket) vs
naive_argmax_rows (torch's argmax): equal ids, ties resolved to the first of equal maxima inside a chunk and across
chunks; the one-launch form's ticket back at 0, its row bound, graph replays."""

from __future__ import annotations

import pytest
import torch

from kernels.sampling.naive import naive_argmax_rows
from kernels.sampling.triton import BLOCK, ONE_LAUNCH_MAX_ROWS, argmax_rows
from tests.kernels.helpers import DEVICE, ON_CUDA


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("s", "v"), [(1, 1), (3, 37), (5, BLOCK), (4, 2 * BLOCK + 3), (17, 5 * BLOCK - 1)])
def test_argmax_matches_torch(s, v, dtype):
    gen = torch.Generator().manual_seed(s * 1000 + v)
    logits = torch.randn(s, v, generator=gen).to(DEVICE, dtype)
    want = naive_argmax_rows(logits)
    assert torch.equal(argmax_rows(logits), want)
    ticket = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # the second launch finds the ticket put back to 0
        assert torch.equal(argmax_rows(logits, ticket=ticket), want)
        assert ticket.item() == 0


def test_ties_take_the_first_column():
    v = 3 * BLOCK + 5
    logits = torch.zeros(6, v, device=DEVICE)
    logits[0, [7, 9]] = 2.0  # inside one chunk
    logits[1, [BLOCK + 1, 2 * BLOCK + 2]] = 2.0  # across chunks: the earlier chunk's column
    logits[2, [3 * BLOCK + 4, BLOCK]] = 5.0  # the last, partial chunk against an earlier one
    logits[3] = float("-inf")  # nothing finite: column 0, as torch
    logits[4, v - 1] = 1.0  # the very last column
    logits[5, [0, v - 1]] = 1.0
    want = naive_argmax_rows(logits)
    assert want.tolist() == [7, BLOCK + 1, BLOCK, 0, v - 1, 0]
    assert torch.equal(argmax_rows(logits), want)
    assert torch.equal(argmax_rows(logits, ticket=torch.zeros(1, dtype=torch.int32, device=DEVICE)), want)


def test_one_launch_reduces_every_row_block_and_keeps_two_launches_past_its_bound():
    """Rows past one block of 16 (the last program's loop), and past ONE_LAUNCH_MAX_ROWS: two launches, the
    ticket untouched (a stale count there would be caught by the next one-launch call's ids)."""
    gen = torch.Generator().manual_seed(3)
    ticket = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    for s in (33, ONE_LAUNCH_MAX_ROWS, ONE_LAUNCH_MAX_ROWS + 1):
        logits = torch.randn(s, BLOCK + 9, generator=gen).to(DEVICE)
        assert torch.equal(argmax_rows(logits, ticket=ticket), naive_argmax_rows(logits)), s
        assert ticket.item() == 0
    with pytest.raises(ValueError, match="ticket must be an int32"):
        argmax_rows(logits[:2], ticket=torch.zeros(2, dtype=torch.int32, device=DEVICE))


@pytest.mark.skipif(not ON_CUDA, reason="a CUDA graph needs CUDA")
def test_one_launch_survives_graph_replays():
    logits = torch.randn(4, 163840, device=DEVICE, dtype=torch.bfloat16)
    ticket = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = torch.empty(4, dtype=torch.int64, device=DEVICE)
    argmax_rows(logits, out, ticket)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        argmax_rows(logits, out, ticket)
    for seed in range(3):
        logits.copy_(torch.randn(4, 163840, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, naive_argmax_rows(logits)) and ticket.item() == 0


def test_writes_into_a_static_view():
    logits = torch.randn(3, 300, device=DEVICE)
    buf = torch.full((8,), -5, dtype=torch.int64, device=DEVICE)
    out = argmax_rows(logits, buf[:3])
    assert out.data_ptr() == buf.data_ptr()
    assert buf[:3].tolist() == logits.argmax(-1).tolist() and buf[3:].tolist() == [-5] * 5
    assert argmax_rows(logits[:0]).numel() == 0


def test_validates():
    logits = torch.randn(2, 10, device=DEVICE)
    with pytest.raises(ValueError, match=r"\[S, V\]"):
        argmax_rows(logits[0])
    with pytest.raises(ValueError, match="contiguous rows"):
        argmax_rows(logits.t())
    with pytest.raises(ValueError, match="int64"):
        argmax_rows(logits, torch.empty(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="empty"):
        argmax_rows(logits[:, :0])


@pytest.mark.skipif(ON_CUDA, reason="records interpreted launches; on a GPU the tests above run both forms")
@pytest.mark.parametrize("one_launch", ["0", "1"])
def test_greedy_backend_takes_the_one_launch_form_when_asked(monkeypatch, one_launch):
    from engine.backends.greedy import TritonGreedy
    from tests.kernels.sm90_compile import record_launches

    monkeypatch.setenv("TANDEM_ARGMAX_ONE_LAUNCH", one_launch)
    logits = torch.randn(2, 3 * BLOCK, device=DEVICE)
    out = torch.empty(2, dtype=torch.int64, device=DEVICE)
    with record_launches() as seen:
        TritonGreedy().argmax_rows(logits, out)
    assert torch.equal(out, naive_argmax_rows(logits))
    kernels = {x.kernel for x in seen}
    two = {"_chunk_max_kernel", "_row_argmax_kernel"}
    assert kernels == ({"_argmax_one_launch_kernel"} if one_launch == "1" else two)
