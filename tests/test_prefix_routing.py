"""Prefix-aware prefill selection: the longest resident prefix, balanced against queued work."""

from __future__ import annotations

import asyncio

from engine.block_hash import block_hashes, namespace
from engine.sampling_params import SamplingParams
from kvstore.index import IndexUnavailableError, MemoryIndex
from router.backend import GenerationRequest
from router.pd_backend import PDBackend
from router.workers import Worker, WorkerRegistry
from tandem.rpc import common_pb2 as cpb

DIGEST = "ab" * 32


def _registry(n: int) -> WorkerRegistry:
    reg = WorkerRegistry()
    for i in range(n):
        info = cpb.WorkerInfo(role=cpb.PREFILL, fingerprint=cpb.Fingerprint(model_digest=DIGEST, page_size=16))
        reg.prefill.append(Worker(f"p{i}:1", "prefill", info, stub=None))
    return reg


def _req(prompt: list[int]) -> GenerationRequest:
    return GenerationRequest("r", prompt, SamplingParams(max_tokens=1))


def test_longest_resident_prefix_wins_unless_busy():
    prompt = list(range(1, 201))
    hashes = block_hashes(namespace(DIGEST), prompt[:-1], 16)
    index = MemoryIndex()
    index.claim("p1:1", hashes[:10], True)  # 160 tokens resident on p1
    index.claim("p2:1", hashes[:3], True)
    reg = _registry(3)
    backend = PDBackend(reg, index)
    assert asyncio.run(backend._pick_prefill(_req(prompt))).endpoint == "p1:1"
    reg.prefill[1].outstanding_tokens = 500  # p1 is busy: its 160-token advantage is gone
    assert asyncio.run(backend._pick_prefill(_req(prompt))).endpoint == "p2:1"  # 48 resident, idle
    assert backend.routed_by_prefix == 2 and backend.prefix_fallbacks == 0


def test_no_hit_or_index_down_falls_back_to_load_and_counts():
    reg = _registry(2)
    reg.prefill[0].outstanding_tokens = 10
    backend = PDBackend(reg, MemoryIndex())
    assert asyncio.run(backend._pick_prefill(_req(list(range(1, 100))))).endpoint == "p1:1"

    class Down(MemoryIndex):
        def resident_prefix(self, instance, hashes):
            raise IndexUnavailableError("redis down")

    backend_down = PDBackend(reg, Down())
    assert asyncio.run(backend_down._pick_prefill(_req(list(range(1, 100))))).endpoint == "p1:1"
    assert backend.prefix_fallbacks == 1 and backend_down.prefix_fallbacks == 1
