"""Reference-counted allocator of fixed-size cache blocks (KV pages or KDA state slots), with an
optional content index for prefix caching.

A block with count 0 is either free, or *cached*: it still holds data filed under a hash and can
be shared again until it is evicted (least recently released first) to satisfy an allocation.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable


class OutOfBlocksError(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, name: str, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"{name} capacity must be >= 0, got {capacity}")
        self.name = name
        self.capacity = capacity
        self._ref = [0] * capacity
        self._free: deque[int] = deque(range(capacity))
        self._cached: OrderedDict[int, None] = OrderedDict()  # count 0, hashed; LRU first
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.on_evict: list[Callable[[bytes, int], None]] = []
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (free ones plus evictable cached ones)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks held by someone (count > 0)."""
        return self.capacity - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocksError(f"{self.name}: asked for {n}, {self.num_free} free of {self.capacity}")
        ids = []
        for _ in range(n):
            if self._free:
                i = self._free.popleft()
            else:
                i, _ = self._cached.popitem(last=False)
                self._evict(i)
            self._ref[i] = 1
            ids.append(i)
        return ids

    def _evict(self, i: int) -> None:
        h = self._hash_of.pop(i)
        del self._block_of[h]
        self.num_evictions += 1
        for cb in self.on_evict:
            cb(h, i)

    def share(self, ids: list[int]) -> None:
        """Take one more reference to each block (a cached block is revived)."""
        for i in ids:
            if self._ref[i] == 0:
                if i not in self._cached:
                    raise ValueError(f"{self.name}: cannot share free block {i}")
                del self._cached[i]
            self._ref[i] += 1

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if self._ref[i] <= 0:
                raise ValueError(f"{self.name}: double free of block {i}")
            self._ref[i] -= 1
            if self._ref[i] == 0:
                if i in self._hash_of:
                    self._cached[i] = None  # most recently released: evicted last
                else:
                    self._free.append(i)

    def ref_count(self, i: int) -> int:
        return self._ref[i]

    # ---- content index ----------------------------------------------------------------------
    def register(self, i: int, h: bytes) -> bool:
        """File block i under hash h. False when h is already filed (under another block)."""
        if h in self._block_of or i in self._hash_of:
            return False
        self._hash_of[i] = h
        self._block_of[h] = i
        return True

    def lookup(self, h: bytes) -> int | None:
        return self._block_of.get(h)

    def hash_of(self, i: int) -> bytes | None:
        return self._hash_of.get(i)
