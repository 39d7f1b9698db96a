"""Triton KDA state slot copy vs kernels/state_copy/naive.py."""

from __future__ import annotations

import pytest
import torch

from kernels.state_copy.naive import naive_copy_state_slots
from kernels.state_copy.triton import copy_state_slots
from tests.kernels.helpers import DEVICE


def _pools(layers, slots=8, h=2, k=16, c=96, width=3, conv_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    rec = [torch.randn(slots, h, k, k, generator=g).to(DEVICE) for _ in range(layers)]
    conv = [torch.randn(slots, c, width, generator=g).to(DEVICE, conv_dtype) for _ in range(layers)]
    return rec, conv


@pytest.mark.parametrize("conv_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("src", "dst", "shift", "width"),
    [
        ([3], [5], None, 3),  # prefix fork: one checkpoint
        ([0, 1, 2], [4, 5, 6], None, 3),  # several pairs
        ([1, 2], [6, 2], [2, 1], 6),  # spec commit: shift by num_accepted - 1, one in place
        ([7], [0], [0], 5),
    ],
)
@pytest.mark.parametrize("layers", [1, 3])
def test_copy(layers, src, dst, shift, width, conv_dtype):
    rec, conv = _pools(layers, width=width, conv_dtype=conv_dtype)
    ref_rec, ref_conv = [x.clone() for x in rec], [x.clone() for x in conv]
    naive_copy_state_slots(ref_rec, ref_conv, src, dst, shift)
    copy_state_slots(rec, conv, src, dst, shift)
    for a, b in zip(rec + conv, ref_rec + ref_conv, strict=True):
        assert torch.equal(a, b)


def test_recurrent_only_and_conv_only():
    rec, conv = _pools(2)
    ref_rec = [x.clone() for x in rec]
    naive_copy_state_slots(ref_rec, [], [1], [2])
    copy_state_slots(rec, [], [1], [2])
    assert all(torch.equal(a, b) for a, b in zip(rec, ref_rec, strict=True))
    ref_conv = [x.clone() for x in conv]
    naive_copy_state_slots([], ref_conv, [4], [3], [1])
    copy_state_slots([], conv, [4], [3], [1])
    assert all(torch.equal(a, b) for a, b in zip(conv, ref_conv, strict=True))


def test_rejects_racy_pairs():
    rec, conv = _pools(1)
    with pytest.raises(ValueError, match="distinct"):
        copy_state_slots(rec, conv, [1, 2], [3, 3])
    with pytest.raises(ValueError, match="source of another pair"):
        copy_state_slots(rec, conv, [1, 3], [3, 4])
    with pytest.raises(ValueError, match="slot ids"):
        copy_state_slots(rec, conv, [1], [99])
