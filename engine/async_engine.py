"""Runs an LLMEngine on its own thread for asyncio services.

The engine is single-threaded by design: every call that touches it runs on the engine thread
between steps (``call``), and each request's outputs are delivered to an asyncio.Queue on the
caller's loop. The step loop never waits on the network.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from engine.llm_engine import LLMEngine, RequestOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.loop = loop
        self._calls: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], asyncio.Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._dead: BaseException | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between steps."""
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead!r}")
        fut: asyncio.Future = self.loop.create_future()
        self._calls.put((fn, fut))
        self._wake.set()
        return await fut

    def open_stream(self, request_id: str, q: asyncio.Queue | None = None) -> asyncio.Queue:
        """Outputs of request_id will be put on this queue (RequestOutput, or an exception)."""
        q = q if q is not None else asyncio.Queue()
        with self._lock:
            self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def deliver(self, request_id: str, item: Any) -> None:
        """Thread-safe: put item on the request's stream (used by engine-thread hooks too)."""
        with self._lock:
            q = self._streams.get(request_id)
        if q is not None:
            self.loop.call_soon_threadsafe(q.put_nowait, item)

    async def abort(self, request_id: str) -> None:
        self.close_stream(request_id)
        if self._dead is None:
            await self.call(lambda e: e.abort_request(request_id))

    # ---- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_calls()
                if self.engine.has_unfinished_requests():
                    outs: list[RequestOutput] = self.engine.step()
                    for out in outs:
                        self.deliver(out.request_id, out)
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as e:  # a failed step poisons every live request: fail them loudly
            logger.exception("engine thread died")
            self._dead = e
            with self._lock:
                streams = list(self._streams.items())
            for _, q in streams:
                self.loop.call_soon_threadsafe(q.put_nowait, EngineDeadError(f"engine failed: {e!r}"))
            self._fail_calls(e)

    def _drain_calls(self) -> None:
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn(self.engine)
            except Exception as e:
                self.loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                self.loop.call_soon_threadsafe(_set_result, fut, result)

    def _fail_calls(self, e: BaseException) -> None:
        while True:
            try:
                _, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            self.loop.call_soon_threadsafe(_set_exception, fut, EngineDeadError(repr(e)))


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
