"""kernels/sampling/triton.py (the greedy ids of a logits batch in two launches) vs naive_argmax_rows (torch's
argmax): equal ids, ties resolved to the first of equal maxima inside a chunk and across chunks."""

from __future__ import annotations

import pytest
import torch

from kernels.sampling.naive import naive_argmax_rows
from kernels.sampling.triton import BLOCK, argmax_rows
from tests.kernels.helpers import DEVICE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("s", "v"), [(1, 1), (3, 37), (5, BLOCK), (4, 2 * BLOCK + 3), (17, 5 * BLOCK - 1)])
def test_argmax_matches_torch(s, v, dtype):
    gen = torch.Generator().manual_seed(s * 1000 + v)
    logits = torch.randn(s, v, generator=gen).to(DEVICE, dtype)
    assert torch.equal(argmax_rows(logits), naive_argmax_rows(logits))


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
