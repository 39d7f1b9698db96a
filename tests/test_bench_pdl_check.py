"""bench/pdl_check.py's verdicts: a run with PDL on must match the ordinary launches bit for bit, mode by mode."""

from __future__ import annotations

import torch

from bench.pdl_check import MODES, compare


def _record(tokens, logits):
    return {mode: {"tokens": [list(t) for t in tokens], "logits": [x.clone() for x in logits]} for mode in MODES}


def test_equal_runs_are_equal_and_any_difference_is_reported():
    logits = [torch.randn(2, 8), torch.randn(1, 8)]
    ref = _record([[1, 2], [3]], logits)
    assert set(compare(ref, _record([[1, 2], [3]], logits), logits=True).values()) == {"equal"}

    one_bit = [logits[0], logits[1].clone()]
    one_bit[1][0, 3] = torch.nextafter(one_bit[1][0, 3], torch.tensor(float("inf")))
    verdict = compare(ref, _record([[1, 2], [3]], one_bit), logits=True)
    assert all(v.startswith("logits differ at 1 steps (first 1") for v in verdict.values()), verdict
    # the control run differed: only tokens are compared, and equal tokens pass
    assert set(compare(ref, _record([[1, 2], [3]], one_bit), logits=False).values()) == {"tokens equal"}

    verdict = compare(ref, _record([[1, 2], [4]], logits), logits=False)
    assert all(v == "tokens differ in 1 of 2 sequences (first: 1)" for v in verdict.values()), verdict


def test_a_process_that_died_reports_the_modes_it_did_not_run():
    logits = [torch.randn(1, 4)]
    ref = _record([[1]], logits)
    partial = {"eager": ref["eager"]}
    verdict = compare(ref, partial, logits=True)
    assert verdict["eager"] == "equal"
    assert verdict["graphs"].startswith("not run") and verdict["overlapped"].startswith("not run")
