"""engine/step_rows.py: the tensor-op rows of long chunks equal the per-token Python rows."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine import step_rows
from engine.step_rows import StepRows


def _chunks(seed: int):
    rng = random.Random(seed)
    out = []
    for _ in range(6):
        start = rng.choice([0, 0, 5, 64, 130])
        n = rng.choice([1, 3, 64, 200, 517])
        ps = 16
        pages = rng.sample(range(1000), -(-(start + n) // ps))
        cached = rng.choice([0, start, start + n // 2, start + n])  # none, all before, half, all reused
        ids = [rng.randrange(50000) for _ in range(n)]
        out.append((ids, start, start + n, pages, cached))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_long_chunk_rows_equal_python_rows(monkeypatch, seed):
    def build(threshold: int, as_numpy: bool = False):
        monkeypatch.setattr(step_rows, "LONG_CHUNK", threshold)
        rows = StepRows(16)
        for ids, start, end, pages, cached in _chunks(seed):
            long = end - start >= threshold
            ids = np.asarray(ids, dtype=np.int64) if as_numpy and long else ids  # as prepare passes prompts
            rows.add(ids, start, end, pages, torch.tensor(pages, dtype=torch.int64), cached)
        return rows.tensors()

    python_only, tensor_ops, mixed = build(10**9), build(1), build(64)
    numpy_ids = build(64, as_numpy=True)
    for a, b, c, d in zip(python_only, tensor_ops, mixed, numpy_ids, strict=True):
        assert a.dtype == b.dtype == c.dtype == d.dtype == torch.int64
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
    assert (python_only[2] == -1).any() and (python_only[2] >= 0).any()  # both kinds of slot are exercised


def test_cached_prefix_marks_exactly_the_reused_rows():
    rows = StepRows(4)
    rows.add(list(range(100)), 10, 110, list(range(28)), torch.arange(28), cached=30)
    _, pos, slot = rows.tensors()
    assert torch.equal(pos, torch.arange(10, 110))
    assert (slot[:20] == -1).all() and torch.equal(slot[20:], torch.arange(30, 110))
