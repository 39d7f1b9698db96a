"""The storage tier behind a thin interface: LMCache's storage manager (local CPU, optional local
disk, optional remote Redis shared by replicas), with our own capacity accounting so that an
eviction is always mirrored in the index.

LMCache 0.5.6 notes (../shared/reference/lmcache.md): telemetry off via LMCACHE_TRACK_USAGE=false
before import; the redis connector's close() deadlocks and is patched; the storage manager must be
closed or the process never exits; objects are stored as [1, 1, nbytes] uint8 tensors (a 1-D shape
breaks LMCache's token accounting on close).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch

logger = logging.getLogger(__name__)


class TierUnavailableError(RuntimeError):
    pass


@dataclass(frozen=True)
class TierConfig:
    local_cpu_bytes: int = 256 << 20
    local_disk_dir: str | None = None
    local_disk_bytes: int = 0
    remote_url: str | None = None
    """redis://host:port: the level shared by replicas on other machines."""
    capacity_bytes: int | None = None
    """Evict (everywhere, index included) beyond this many bytes filed by this process."""


def _patch_lmcache_close() -> None:
    from lmcache.v1.storage_backend.connector import redis_connector as rc

    async def _close_redis(self):  # upstream awaits a blocking shutdown on its own loop: deadlock
        await self.connection.aclose()

    async def _close_resp(self):
        self.client.close()

    rc.RedisConnector.close = _close_redis
    rc.RESPConnector.close = _close_resp


class LMCacheTier:
    def __init__(self, config: TierConfig, model_tag: str) -> None:
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.storage_manager import StorageManager

        _patch_lmcache_close()
        self._key_cls, self._fmt = CacheEngineKey, MemoryFormat.KV_2LTD
        kw = dict(chunk_size=16, local_cpu=True, max_local_cpu_size=max(config.local_cpu_bytes / 1e9, 0.001))
        if config.local_disk_dir:
            kw.update(local_disk=config.local_disk_dir, max_local_disk_size=config.local_disk_bytes / 1e9)
        if config.remote_url:
            kw.update(remote_url=config.remote_url, remote_serde="naive")
        cfg = LMCacheEngineConfig.from_defaults(save_unfull_chunk=True, blocking_timeout_secs=2, **kw)
        meta = LMCacheMetadata(
            model_name=model_tag,
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.uint8,
            kv_shape=(1, 2, 16, 1, 1),
            chunk_size=16,
        )
        self.model_tag = model_tag
        self.config = config
        self._sm = StorageManager(cfg, meta, event_manager=EventManager())
        self._lock = threading.Lock()
        self._sizes: OrderedDict[tuple[int, bytes], int] = OrderedDict()
        self.bytes = 0
        self.on_evict: list[Callable[[int, bytes], None]] = []
        self.num_evictions = 0
        self._unconfirmed: set = set()
        self._remote_down_until = 0.0

    def _key(self, kind: int, h: bytes):
        return self._key_cls(
            self.model_tag, 1, 0, int.from_bytes(h[:8], "big", signed=True), torch.uint8,
            request_configs={"lmcache.tag.kind": str(kind)},
        )  # fmt: skip

    def put(self, kind: int, h: bytes, blob: bytes) -> None:
        """Store an entry. With a remote level this returns once the remote holds it: LMCache 0.5.6's
        redis connector corrupts its connection under concurrent large puts (the server drops it,
        then a write touches freed memory: segfault seen), so puts go one at a time."""
        import time

        if self.config.remote_url and time.monotonic() < self._remote_down_until:
            raise TierUnavailableError("the remote tier level failed recently; not filing for now")
        key = self._put(kind, h, blob)
        if self.config.remote_url and not self._confirm(key, timeout=1.0):
            self._remote_down_until = time.monotonic() + 2.0  # circuit breaker: don't queue behind an outage
            with self._lock:
                self._unconfirmed.discard(key)
            raise TierUnavailableError(f"tier put of {h.hex()[:16]} not confirmed by the remote level")

    def _confirm(self, key, timeout: float) -> bool:
        import time

        deadline = time.monotonic() + timeout
        while not self._sm.contains(key, ["RemoteBackend"]):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        with self._lock:
            self._unconfirmed.discard(key)
        return True

    def _put(self, kind: int, h: bytes, blob: bytes):
        data = torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(1, 1, -1)
        with self._lock:
            obj = self._sm.allocate(torch.Size(data.shape), torch.uint8, fmt=self._fmt, busy_loop=False)
            if obj is None:
                raise MemoryError("LMCache local CPU pool is full")
            obj.tensor.copy_(data)
            key = self._key(kind, h)
            if len(self._sm.storage_backends) > 1:
                self._unconfirmed.add(key)
            self._sm.batched_put([key], [obj])
            self._account(kind, h, len(blob))
            return key

    def _account(self, kind: int, h: bytes, size: int) -> None:
        k = (kind, h)
        self.bytes += size - self._sizes.pop(k, 0)
        self._sizes[k] = size
        cap = self.config.capacity_bytes
        while cap is not None and self.bytes > cap and len(self._sizes) > 1:
            (old_kind, old_h), old_size = self._sizes.popitem(last=False)
            self.bytes -= old_size
            self._unconfirmed.discard(self._key(old_kind, old_h))
            self._sm.remove(self._key(old_kind, old_h))
            self.num_evictions += 1
            for cb in self.on_evict:
                cb(old_kind, old_h)

    def get(self, kind: int, h: bytes) -> bytes | None:
        with self._lock:
            obj = self._sm.get(self._key(kind, h))
            if obj is None:
                return None
            try:
                blob = obj.tensor.reshape(-1).numpy().tobytes()
            finally:
                obj.ref_count_down()
            if (kind, h) in self._sizes:
                self._sizes.move_to_end((kind, h))
            return blob

    def remove(self, kind: int, h: bytes) -> None:
        with self._lock:
            self._unconfirmed.discard(self._key(kind, h))
            self._sm.remove(self._key(kind, h))
            size = self._sizes.pop((kind, h), None)
            if size is not None:
                self.bytes -= size

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until LMCache's asynchronous puts (disk, remote) are done: no put task pending and the
        last key put is visible in every level (put tasks register asynchronously, so both)."""
        import time

        deadline = time.monotonic() + timeout
        levels = [n for n in self._sm.storage_backends if n != "LocalCPUBackend"]
        while True:
            pending = any(getattr(b, "put_tasks", None) for b in self._sm.storage_backends.values())
            with self._lock:  # puts run concurrently upstream: confirm every key, not just the last
                self._unconfirmed = {k for k in self._unconfirmed if not all(self._sm.contains(k, [n]) for n in levels)}
                left = len(self._unconfirmed)
            if not pending and not left:
                return True
            if time.monotonic() > deadline:
                logger.warning("tier drain timed out with %d puts unconfirmed", left)
                return False
            time.sleep(0.0005)

    def close(self) -> None:
        # LMCache 0.5.6 closes the local CPU backend (freeing the pool) before the remote one, whose
        # connection may still be writing from that memory: a use-after-free (segfault seen). Drain,
        # then close every other backend first.
        # Its RemoteBackend.close() can also wait forever on its executor's queue; we close the Redis
        # connection ourselves, with a timeout.
        self.drain(timeout=5.0)
        with self._lock:
            backends = self._sm.storage_backends
            remote = backends.pop("RemoteBackend", None)
            if remote is not None:
                conn = getattr(remote.connection, "_connector", remote.connection)
                try:
                    asyncio.run_coroutine_threadsafe(conn.close(), remote.loop).result(timeout=5)
                except Exception as e:  # best effort: the pool must still be freed last
                    logger.warning("closing the LMCache remote connection: %r", e)
            for name in [n for n in backends if n != "LocalCPUBackend"]:
                try:
                    backends.pop(name).close()
                except Exception as e:
                    logger.warning("closing LMCache backend %s: %s", name, e)
            self._sm.close()
