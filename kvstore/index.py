"""The prefix index: for each block hash, whether the tier holds its KV page / KDA checkpoint, and
which prefill instances hold it in device memory.

Redis layout (every key expires, so a dead instance's claims vanish on their own):
    tandem:e:<hex>           HASH kv, kda (0/1), kv_size, kda_size, last_use   TTL entry_ttl_s
    tandem:g:<instance>      SET of <hex> resident on that instance's device  TTL instance_ttl_s,
                                                                            refreshed by heartbeat
Embedded default (no Redis URL): the same operations on in-process dicts.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod

import redis

from kvstore.entry import KIND_KDA, KIND_KV

_FIELD = {KIND_KV: "kv", KIND_KDA: "kda"}


class IndexUnavailableError(RuntimeError):
    """The index cannot be reached; callers serve without prefix hits and count it."""


class PrefixIndex(ABC):
    @abstractmethod
    def publish(self, entries: list[tuple[int, bytes, int]]) -> None:
        """(kind, hash, size) now held by the tier."""

    @abstractmethod
    def unpublish(self, kind: int, h: bytes) -> None: ...

    @abstractmethod
    def in_tier(self, kind: int, hashes: list[bytes]) -> list[bool]: ...

    @abstractmethod
    def claim(self, instance: str, hashes: list[bytes], resident: bool) -> None:
        """Instance now holds (resident=True) or dropped (False) these hashes on its device."""

    @abstractmethod
    def resident_prefix(self, instance: str, hashes: list[bytes]) -> int:
        """How many leading hashes the instance holds on its device."""

    @abstractmethod
    def heartbeat(self, instance: str) -> None: ...

    def tier_prefix(self, hashes: list[bytes]) -> int:
        n = 0
        for present in self.in_tier(KIND_KV, hashes):
            if not present:
                break
            n += 1
        return n

    def close(self) -> None:  # noqa: B027 - optional
        pass


class MemoryIndex(PrefixIndex):
    def __init__(self) -> None:
        self._entries: dict[tuple[int, bytes], int] = {}
        self._resident: dict[str, set[bytes]] = {}
        self._lock = threading.Lock()

    def publish(self, entries: list[tuple[int, bytes, int]]) -> None:
        with self._lock:
            for kind, h, size in entries:
                self._entries[(kind, h)] = size

    def unpublish(self, kind: int, h: bytes) -> None:
        with self._lock:
            self._entries.pop((kind, h), None)

    def in_tier(self, kind: int, hashes: list[bytes]) -> list[bool]:
        with self._lock:
            return [(kind, h) in self._entries for h in hashes]

    def claim(self, instance: str, hashes: list[bytes], resident: bool) -> None:
        with self._lock:
            s = self._resident.setdefault(instance, set())
            (s.update if resident else s.difference_update)(hashes)

    def resident_prefix(self, instance: str, hashes: list[bytes]) -> int:
        with self._lock:
            s = self._resident.get(instance, set())
            n = 0
            while n < len(hashes) and hashes[n] in s:
                n += 1
            return n

    def heartbeat(self, instance: str) -> None:
        pass


class RedisIndex(PrefixIndex):
    def __init__(self, url: str, entry_ttl_s: int = 24 * 3600, instance_ttl_s: int = 30, timeout_s: float = 0.5):
        self.r = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.entry_ttl_s = entry_ttl_s
        self.instance_ttl_s = instance_ttl_s

    def _do(self, fn):
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            raise IndexUnavailableError(f"redis index unavailable: {e}") from e

    def publish(self, entries: list[tuple[int, bytes, int]]) -> None:
        def run():
            p = self.r.pipeline(transaction=False)
            now = int(time.time())
            for kind, h, size in entries:
                key = f"tandem:e:{h.hex()}"
                p.hset(key, mapping={_FIELD[kind]: 1, f"{_FIELD[kind]}_size": size, "last_use": now})
                p.expire(key, self.entry_ttl_s)
            p.execute()

        self._do(run)

    def unpublish(self, kind: int, h: bytes) -> None:
        self._do(lambda: self.r.hset(f"tandem:e:{h.hex()}", _FIELD[kind], 0))

    def in_tier(self, kind: int, hashes: list[bytes]) -> list[bool]:
        def run():
            p = self.r.pipeline(transaction=False)
            for h in hashes:
                p.hget(f"tandem:e:{h.hex()}", _FIELD[kind])
            return [v == b"1" for v in p.execute()]

        return self._do(run) if hashes else []

    def claim(self, instance: str, hashes: list[bytes], resident: bool) -> None:
        if not hashes:
            return
        key = f"tandem:g:{instance}"

        def run():
            p = self.r.pipeline(transaction=False)
            (p.sadd if resident else p.srem)(key, *[h.hex() for h in hashes])
            p.expire(key, self.instance_ttl_s)
            p.execute()

        self._do(run)

    def resident_prefix(self, instance: str, hashes: list[bytes]) -> int:
        if not hashes:
            return 0
        flags = self._do(lambda: self.r.smismember(f"tandem:g:{instance}", [h.hex() for h in hashes]))
        n = 0
        while n < len(flags) and flags[n]:
            n += 1
        return n

    def heartbeat(self, instance: str) -> None:
        self._do(lambda: self.r.expire(f"tandem:g:{instance}", self.instance_ttl_s))

    def close(self) -> None:
        self.r.close()


def make_index(redis_url: str | None) -> PrefixIndex:
    return RedisIndex(redis_url) if redis_url else MemoryIndex()
