"""Host time spent inside chosen methods during one block: each is wrapped (two clock reads a call) and put
back afterwards. Nothing else is instrumented, so the rest of the code runs at its own speed."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CallTimes:
    spent: dict[str, float] = field(default_factory=dict)
    """Seconds inside the methods of each key."""
    first_start: dict[str, float] = field(default_factory=dict)
    """perf_counter() at the first call of each key."""


@contextlib.contextmanager
def timed_calls(targets: Iterable[tuple[Any, str, str]]) -> Iterator[CallTimes]:
    """Times ``obj.name`` under ``key`` for each (obj, name, key) while the block runs."""
    times = CallTimes()
    restore: list[tuple[Any, str, Any]] = []
    depth: dict[str, int] = {}  # a call under the same key inside another (a wrapper calling the method it wraps)
    # is not counted twice: only the outermost call's time goes to the key

    def wrap(fn: Any, key: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            times.first_start.setdefault(key, t0)
            depth[key] = depth.get(key, 0) + 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[key] -= 1
                if not depth[key]:
                    times.spent[key] += time.perf_counter() - t0

        return call

    for obj, name, key in targets:
        times.spent.setdefault(key, 0.0)
        restore.append((obj, name, vars(obj).get(name)))  # an instance attribute to put back, or None
        setattr(obj, name, wrap(getattr(obj, name), key))
    try:
        yield times
    finally:
        for obj, name, own in reversed(restore):
            if own is None:
                delattr(obj, name)  # the class attribute shows through again
            else:
                setattr(obj, name, own)
