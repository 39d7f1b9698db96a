"""P/D handoff with parallel workers, on both sides of the wire.

Producer (prefill, pcp x pp): every stage holds only its own layers' pages and KDA state, so every
stage produces the handoff chunks of its layers (PCP ranks hold full replicas; the stage leader
produces). Rank 0's stage streams them straight into the gRPC response as its layers finish; the
other stages' leaders collect theirs during the step and send them to rank 0 right after it, and rank 0
passes them into the same response. The decode side therefore pulls ONE stream per request, from one
endpoint, whatever the prefill layout: the union of all stages' chunks, in any layer order, which the
consumer already accepts (chunks carry their layer index). Chosen over "D pulls from every stage's
endpoint" because the router and decode workers stay layout-blind and cancellation / cleanup stays in
one place; the cost is one extra hop (stage -> rank 0, on-host) for stages > 0. docs/PARALLEL.md.

Consumer (decode, tp x pp): the handoff arrives in canonical layout (full heads, token order) into a
CPU staging copy of the request; on insert, rank 0 cuts every rank's share (its stage's layers, its TP
heads) and sends it; every rank writes its share into the pages / slot rank 0 reserved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.cache.tensors import CacheLayout, CacheTensors
from engine.config import EngineConfig
from engine.kv_transfer.producer import HandoffProducer
from engine.kv_transfer.wire import EncodedChunk
from engine.model_config import ModelConfig
from engine.parallel.tp import TPPlan


class RelayProducer:
    """A producer stage's chunks, collected during a step and sent to rank 0 after it."""

    def __init__(self, cfg: ModelConfig, cache: CacheTensors, page_size: int) -> None:
        self.producer = HandoffProducer(cfg, cache, page_size)
        self.outbox: list[tuple[str, EncodedChunk]] = []
        self.active: set[str] = set()

    def begin(self, streams: dict[str, int]) -> None:
        """Follow rank 0's registrations: its producer lists every request streaming right now."""
        for rid in self.active - streams.keys():
            self.producer.unregister(rid)
        for rid, max_bytes in streams.items():
            if rid not in self.active:
                self.producer.register(rid, self._sink(rid), max_bytes)
        self.active = set(streams)

    def _sink(self, rid: str) -> Callable[[EncodedChunk], None]:
        return lambda chunk: self.outbox.append((rid, chunk))

    def take(self) -> list[tuple[str, EncodedChunk]]:
        out, self.outbox = self.outbox, []
        return out


def deliver_relayed(producer: HandoffProducer, chunks: list[tuple[str, EncodedChunk]]) -> None:
    for rid, chunk in chunks:
        producer.deliver(rid, chunk)


# ---- consumer side -------------------------------------------------------------------------------------
def staging_cache(cfg: ModelConfig, num_tokens: int, page_size: int, dtype: torch.dtype) -> CacheTensors:
    """A request-sized canonical cache on the CPU: pages 0..n-1, slot 0, every layer, full heads."""
    layout = CacheLayout(page_size=page_size, num_pages=-(-num_tokens // page_size), num_slots=1)
    return CacheTensors(cfg, layout, dtype, torch.device("cpu"))


@dataclass
class ImportSlice:
    """One rank's share of an imported request: its layers, its heads."""

    page_ids: list[int]
    slot_id: int | None
    num_tokens: int
    kv: dict[int, torch.Tensor]
    """layer -> [num_tokens, *local kv entry]"""
    recurrent: dict[int, torch.Tensor]
    conv: dict[int, torch.Tensor]


def slice_for_rank(
    config: EngineConfig,
    cfg: ModelConfig,
    staging: CacheTensors,
    num_tokens: int,
    page_ids: list[int],
    slot_ids: list[int],
    rank: int,
) -> ImportSlice:
    p = config.parallel
    layers = p.stage_layers(cfg.num_hidden_layers, p.stage_of(rank))
    tp = TPPlan(cfg, p.tp, p.inner_rank_of(rank) if p.tp > 1 else 0, shard_lm_head=False)
    return ImportSlice(
        page_ids=page_ids,
        slot_id=slot_ids[0] if slot_ids else None,
        num_tokens=num_tokens,
        kv={i: tp.local_kv(t.flatten(0, 1)[:num_tokens]).clone() for i, t in staging.kv.items() if i in layers},
        recurrent={i: tp.local_recurrent(t[0]).clone() for i, t in staging.recurrent.items() if i in layers},
        conv={i: tp.local_conv(t[0]).clone() for i, t in staging.conv.items() if i in layers},
    )


def write_slice(cache: CacheTensors, s: ImportSlice) -> None:
    ps = cache.layout.page_size
    for layer, rows in s.kv.items():
        for p, page in enumerate(s.page_ids):
            part = rows[p * ps : (p + 1) * ps]
            cache.kv[layer][page, : part.shape[0]] = part.to(cache.kv[layer].device)
    if s.slot_id is not None:
        for layer, t in s.recurrent.items():
            cache.recurrent[layer][s.slot_id] = t.to(cache.recurrent[layer].device)
        for layer, t in s.conv.items():
            cache.conv[layer][s.slot_id] = t.to(cache.conv[layer].device)
