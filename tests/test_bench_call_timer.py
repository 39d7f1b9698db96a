"""bench/call_timer.py: time inside wrapped methods, and the methods put back afterwards."""

from __future__ import annotations

import time

from bench.call_timer import timed_calls


class _Worker:
    def slow(self) -> str:
        time.sleep(0.02)
        return "slow"

    def fast(self) -> str:
        return "fast"


def test_spent_time_per_key_and_methods_restored():
    w = _Worker()
    own = lambda: "own"  # an instance attribute the timer must put back, not delete
    w.fast = own
    with timed_calls([(w, "slow", "a"), (w, "fast", "b")]) as times:
        t0 = time.perf_counter()
        assert w.slow() == "slow" and w.slow() == "slow" and w.fast() == "own"
    assert 0.04 <= times.spent["a"] < 0.5 and times.spent["b"] < 0.01
    assert t0 <= times.first_start["a"] <= times.first_start["b"]
    assert "slow" not in vars(w) and w.fast is own  # the class method shows through again; the own one stays


class _Nested:
    def outer(self) -> str:
        time.sleep(0.05)
        return self.inner()

    def inner(self) -> str:
        time.sleep(0.05)
        return "inner"


def test_nested_calls_under_one_key_count_once():
    """A method and the method it calls timed under one key (the KDA layer's gated call and the core it runs):
    the outer call's time, not the sum of both."""
    n = _Nested()
    with timed_calls([(n, "outer", "core"), (n, "inner", "core")]) as times:
        assert n.outer() == "inner"
        assert n.inner() == "inner"  # a call of its own still counts
    assert 0.15 <= times.spent["core"] < 0.19  # 100 ms outer (its inner call inside) + 50 ms inner alone, not 200
