"""P/D handoff with parallel workers, on both sides of the wire.

Producer (prefill, pcp x pp): every stage holds only its own layers' pages and KDA state, so every
stage produces the handoff chunks of its layers (PCP ranks hold full replicas; the stage leader
produces) and streams them to the decode side itself: rank 0 in the worker's Prefill stream, stages > 0
from their own endpoints, which that stream's header announces (engine/parallel/stage_stream.py). The
router stays layout-blind: it names one prefill endpoint; the decode side learns the rest from it.

Consumer (decode, tp x pp): the handoff arrives in canonical layout (full heads, token order) into a
CPU staging copy of the request; on insert, rank 0 cuts every rank's share (its stage's layers, its TP
heads) and sends it; every rank writes its share into the pages / slot rank 0 reserved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cache.tensors import CacheLayout, CacheTensors
from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.parallel.tp import TPPlan


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
