"""bench/mid/tandem_bench.decode_steps_timed on a fake clock: the mean (a synced, idle start to the end of the last
step, as earlier sessions report) against the median gap between step() returns (one step in steady state)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from bench.mid import tandem_bench


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_overlapped_steps_median_drops_the_idle_start_and_the_drain(monkeypatch):
    clock = _Clock()
    costs = iter([0.5, 0.5] + [0.1, 1.0, 1.0, 1.0, 1.0])  # warm-up, then: the first return finds its step done

    class Engine:
        device = torch.device("cpu")
        n = 0

        def step(self):
            clock.now += next(costs)
            self.n += 1
            return [SimpleNamespace(output_token_ids=[self.n])]

    drains = iter([0.0, 1.0])  # the sync after the warm-up finds nothing; the last one waits a step in flight
    monkeypatch.setattr(tandem_bench.time, "perf_counter", clock)
    monkeypatch.setattr(tandem_bench, "sync", lambda device: setattr(clock, "now", clock.now + next(drains)))
    t = tandem_bench.decode_steps_timed(Engine(), 5, warmup=2)
    assert t.tokens == [[3], [4], [5], [6], [7]]
    assert abs(t.mean - 5.1 / 5) < 1e-12 and t.median == 1.0
    clock.now, costs, drains = 0.0, iter([0.5, 0.5, 1.0]), iter([0.0, 0.0])
    assert tandem_bench.decode_steps_timed(Engine(), 1).median == 1.0  # one step: no gap, the mean
