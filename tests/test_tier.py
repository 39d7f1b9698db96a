"""The LMCache-backed tier on its own: entries round-trip through local CPU and local disk, corrupt
entries are refused, our capacity evicts (and reports) least recently used first."""

from __future__ import annotations

import hashlib
import time

import pytest
import torch

from kvstore.entry import KIND_KDA, KIND_KV, CorruptEntryError, TierEntry, decode, encode
from kvstore.tier import LMCacheTier, TierConfig


def _h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


@pytest.fixture
def disk_tier(tmp_path):
    tier = LMCacheTier(
        TierConfig(local_cpu_bytes=8 << 20, local_disk_dir=str(tmp_path), local_disk_bytes=64 << 20), "t"
    )
    yield tier
    tier.close()


def test_entry_roundtrip_and_corruption():
    e = TierEntry(KIND_KV, _h(1), list(range(16)), [torch.randn(16, 40), torch.randn(2, 3).to(torch.bfloat16)])
    blob = encode(e)
    back = decode(blob, _h(1), KIND_KV)
    assert back.tokens == e.tokens and all(torch.equal(a, b) for a, b in zip(back.tensors, e.tensors, strict=True))
    bad = bytearray(blob)
    bad[-5] ^= 1
    with pytest.raises(CorruptEntryError, match="checksum"):
        decode(bytes(bad), _h(1), KIND_KV)
    with pytest.raises(CorruptEntryError, match="another hash"):
        decode(blob, _h(2), KIND_KV)
    with pytest.raises(CorruptEntryError, match="another hash or kind"):
        decode(blob, _h(1), KIND_KDA)


def test_local_disk_level_serves_after_cpu_eviction(disk_tier):
    blob = encode(TierEntry(KIND_KV, _h(3), [1, 2, 3], [torch.arange(1000, dtype=torch.float32)]))
    disk_tier.put(KIND_KV, _h(3), blob)
    deadline = time.monotonic() + 10
    key = disk_tier._key(KIND_KV, _h(3))
    while not disk_tier._sm.contains(key, ["LocalDiskBackend"]):  # the disk write is asynchronous
        assert time.monotonic() < deadline, "never written to the local disk level"
        time.sleep(0.02)
    disk_tier._sm.storage_backends["LocalCPUBackend"].remove(key)  # gone from memory, still on disk
    assert disk_tier.get(KIND_KV, _h(3)) == blob


def test_capacity_evicts_lru_and_reports():
    tier = LMCacheTier(TierConfig(local_cpu_bytes=8 << 20, capacity_bytes=3000), "t")
    evicted = []
    tier.on_evict.append(lambda kind, h: evicted.append(h))
    try:
        for i in range(4):
            tier.put(KIND_KV, _h(i), bytes([i]) * 1000)
        tier.get(KIND_KV, _h(1))  # touched: not the next victim
        tier.put(KIND_KV, _h(9), b"x" * 1000)
        assert evicted == [_h(0), _h(2)]
        assert tier.get(KIND_KV, _h(0)) is None and tier.get(KIND_KV, _h(1)) is not None
        assert tier.bytes <= 3000
    finally:
        tier.close()
