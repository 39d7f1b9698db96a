"""Reference-counted allocator of fixed-size cache blocks (KV pages or KDA state slots).

An id is free when its count is 0. Sharing (prefix cache hits, forks) increments the count; a
block returns to the free list when its last holder releases it.
"""

from __future__ import annotations

from collections import deque


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

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"{self.name}: asked for {n}, {len(self._free)} free of {self.capacity}")
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._ref[i] = 1
        return ids

    def share(self, ids: list[int]) -> None:
        for i in ids:
            if self._ref[i] <= 0:
                raise ValueError(f"{self.name}: cannot share free block {i}")
            self._ref[i] += 1

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if self._ref[i] <= 0:
                raise ValueError(f"{self.name}: double free of block {i}")
            self._ref[i] -= 1
            if self._ref[i] == 0:
                self._free.append(i)

    def ref_count(self, i: int) -> int:
        return self._ref[i]
