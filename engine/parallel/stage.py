"""One rank's part of the model and its caches: the layers of its pipeline stage, TP-sharded.

The full model is built on the meta device (no memory), layers other stages own are replaced by
``MissingLayer``, sharded parameters are shrunk to their local shape, and only then is memory
allocated and the rank's slice of every checkpoint tensor loaded.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.backends import Backends, select_backends
from engine.cache.budget import cache_budget_bytes
from engine.cache.tensors import CacheLayout, CacheTensors, _kv_bytes_per_page, state_bytes_per_slot
from engine.config import EngineConfig
from engine.loader import checkpoint_files, load_weights
from engine.model_config import ModelConfig
from engine.models.base import CausalLM, pack_for_device
from engine.models.layers import RotaryEmbedding
from engine.models.registry import build_model
from engine.parallel.groups import ParallelGroups
from engine.parallel.pcp import PCPAttentionBackend
from engine.parallel.pcp_kda import PCPKDABackend
from engine.parallel.tp import TPPlan

logger = logging.getLogger(__name__)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class MissingLayer(nn.Module):
    """A layer another pipeline stage owns: no parameters, never called."""

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError("a MissingLayer ran: this layer belongs to another pipeline stage")


@dataclass
class Stage:
    model: CausalLM
    layers: range
    tp: TPPlan
    local_cfg: ModelConfig
    """Head counts of this rank (TP); the cache tensors are sized by it."""


def shard_lm_head(config: EngineConfig, device: torch.device) -> bool:
    want = config.parallel.tp_shard_lm_head
    return device.type == "cuda" if want is None else want


def build_stage(
    config: EngineConfig, cfg: ModelConfig, groups: ParallelGroups, dtype: torch.dtype, device: torch.device
) -> Stage:
    p = config.parallel
    layers = p.stage_layers(cfg.num_hidden_layers, groups.stage)
    tp = TPPlan(cfg, p.tp, groups.inner_rank if p.tp > 1 else 0, shard_lm_head(config, device))
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = build_model(cfg)
    finally:
        torch.set_default_dtype(old)
    for i in range(cfg.num_hidden_layers):
        if i not in layers:
            model.model.layers[i] = MissingLayer()
    first, last = groups.is_first_stage, groups.is_last_stage
    if not first:
        model.model.embed_tokens = None
    if not last:
        model.model.norm = None
        model.lm_head = None
    tp.shard_parameters(model)
    model.to_empty(device=device)
    _reset_buffers(model, cfg, device)
    tied = cfg.tie_word_embeddings
    if tied and first and last:  # to_empty gave the two modules separate tensors: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight

    def pick(name: str, t: torch.Tensor, expert: bool) -> tuple[str, torch.Tensor] | None:
        m = _LAYER.match(name)
        if m is not None and int(m.group(1)) not in layers:
            return None
        if name.startswith("model.embed_tokens."):
            if not first:  # a tied LM head on a later stage loads the embedding as its weight
                return ("lm_head.weight", t) if tied and last else None
        elif (name.startswith("model.norm.") or name.startswith("lm_head.")) and not last:
            return None
        shape = (0, *t.shape) if expert else tuple(t.shape)
        shard = tp.shard_of(name, shape)
        if shard is None:
            return name, t
        if expert:  # one expert's slice of the stacked [E, ...] parameter
            return name, t.narrow(shard.dim - 1, shard.start, shard.size)
        return name, shard.take(t)

    progress = config.load_progress and groups.rank == 0  # one progress bar, not one a rank
    load_weights(model, checkpoint_files(Path(config.model)), progress=progress, transform=pick)
    model.eval().requires_grad_(False)
    pack_for_device(model, device)  # each rank packs its own shards
    tp.install_reductions(model, groups)
    model.backends = stage_backends(device, groups)
    return Stage(model, layers, tp, tp.local_model_config())


def _reset_buffers(model: nn.Module, cfg: ModelConfig, device: torch.device) -> None:
    """Non-persistent buffers are not in the checkpoint and were lost on the meta device."""
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.inv_freq = RotaryEmbedding(cfg.head_dim, cfg.rope_theta).inv_freq.to(device)


def stage_backends(device: torch.device, groups: ParallelGroups) -> Backends:
    be = select_backends(device)
    if groups.config.pcp == 1:
        return be
    return dataclasses.replace(be, attention=PCPAttentionBackend(be.attention), kda=PCPKDABackend(be.kda))


# ---- caches -------------------------------------------------------------------------------------------
def plan_stage_cache(
    config: EngineConfig, stage: Stage, groups: ParallelGroups, dtype: torch.dtype, device: torch.device
) -> CacheLayout:
    """Every rank sizes its own layers' pages from its budget; the pool is the smallest of them, so a
    page id means the same page on every rank. Slots: the same count everywhere (``plan_cache``)."""
    cfg = stage.local_cfg
    weight_bytes = sum(p.numel() * p.element_size() for p in stage.model.parameters())
    budget = cache_budget_bytes(config, device, weight_bytes)
    kda_here = [i for i in cfg.kda_layers if i in stage.layers]
    attn_here = [i for i in cfg.attention_layers if i in stage.layers]
    num_slots = config.max_num_seqs if cfg.kda_layers else 0
    if num_slots and config.enable_prefix_caching:
        extra = config.num_checkpoint_slots
        num_slots += 2 * config.max_num_seqs if extra is None else extra
    slot_bytes = num_slots * state_bytes_per_slot(cfg, dtype) * len(kda_here) // max(len(cfg.kda_layers), 1)
    per_layer_page = _kv_bytes_per_page(cfg, config.page_size, dtype) // max(len(cfg.attention_layers), 1)
    page_bytes = per_layer_page * len(attn_here)
    if slot_bytes >= budget:
        raise ValueError(
            f"rank {groups.rank}: cache budget {budget} B cannot hold the KDA state of "
            f"max_num_seqs={config.max_num_seqs} requests ({slot_bytes} B)"
        )
    big = 1 << 62  # a stage without attention layers does not limit the page pool
    mine = torch.tensor([(budget - slot_bytes) // page_bytes if page_bytes else big], dtype=torch.int64)
    torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MIN, group=groups.cpu)
    num_pages = int(mine.item())
    if num_pages == big:
        num_pages = 0
    return CacheLayout(page_size=config.page_size, num_pages=num_pages, num_slots=num_slots)


def make_stage_cache(stage: Stage, layout: CacheLayout, dtype: torch.dtype, device: torch.device) -> CacheTensors:
    return CacheTensors(stage.local_cfg, layout, dtype, device, layers=set(stage.layers))
