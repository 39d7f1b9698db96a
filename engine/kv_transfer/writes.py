"""Handoff payload checks and copies on worker threads, off the event loop that receives the handoff.

A decode worker receives every stream of a handoff (prefill stream, lanes, stage streams) on one asyncio
loop. Per message the loop would also verify the piece's CRC-32 and copy it into the reserved pages;
both release the GIL (zlib-ng's crc32 on large buffers, numpy's copy), so here they run on a small shared
thread pool while the loop goes on receiving. The consumer books every piece (bounds, overlaps, totals)
on the loop as before; only the bytes move later. Nothing is used before ``wait()``: the consumer waits
before it checks a handoff complete, and before its reservation is released on failure, so no copy ever
lands in pages that were handed to another request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
THREADS = 4


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(THREADS, thread_name_prefix="handoff-write")
        return _POOL


class PayloadWrites:
    """The pending payload jobs of one handoff. ``max_pending`` bounds the bytes held in flight (a full
    queue makes the receiver wait: backpressure onto the gRPC streams)."""

    def __init__(self, max_pending: int = 32) -> None:
        self._slots = threading.BoundedSemaphore(max_pending)
        self._idle = threading.Condition()
        self._pending = 0
        self.error: BaseException | None = None

    def submit(self, job: Callable[[], None]) -> None:
        self._slots.acquire()
        with self._idle:
            self._pending += 1
        _pool().submit(self._run, job)

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:  # reported by the consumer on its next message or when it finishes
            with self._idle:
                if self.error is None:
                    self.error = e
        finally:
            self._slots.release()
            with self._idle:
                self._pending -= 1
                if self._pending == 0:
                    self._idle.notify_all()

    def wait(self) -> None:
        """Until every submitted job has run."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)
