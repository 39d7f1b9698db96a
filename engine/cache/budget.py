"""Size the page pool and slot pool from a memory budget (vLLM's gpu_memory_utilization idea)."""

from __future__ import annotations

import logging

import torch

from engine.cache.tensors import CacheLayout, _kv_bytes_per_page, state_bytes_per_slot
from engine.config import EngineConfig
from engine.model_config import ModelConfig

logger = logging.getLogger(__name__)

CPU_DEFAULT_CACHE_BYTES = 256 << 20


def cache_budget_bytes(config: EngineConfig, device: torch.device, weight_bytes: int) -> int:
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free - weight_bytes  # other processes' memory is not ours to take
        budget = int(total * config.gpu_memory_utilization) - weight_bytes - max(used_by_others, 0)
        if budget <= 0:
            raise ValueError(
                f"no memory left for the KV cache: total {total >> 20} MiB x gpu_memory_utilization "
                f"{config.gpu_memory_utilization} < weights {weight_bytes >> 20} MiB + other use"
            )
        return budget
    return CPU_DEFAULT_CACHE_BYTES


def plan_cache(
    cfg: ModelConfig, config: EngineConfig, dtype: torch.dtype, budget: int, slots_per_seq: int = 1
) -> CacheLayout:
    """Slots first (every running request needs its KDA state), the rest becomes pages."""
    num_slots = config.max_num_seqs * slots_per_seq if cfg.kda_layers else 0
    if num_slots and config.cuda_graphs:
        num_slots += 1  # the padding rows' scratch slot of static decode steps (engine/decode_graph)
    if num_slots and config.enable_prefix_caching:
        extra = config.num_checkpoint_slots
        num_slots += 2 * config.max_num_seqs if extra is None else extra
    slot_bytes = num_slots * state_bytes_per_slot(cfg, dtype)
    page_bytes = _kv_bytes_per_page(cfg, config.page_size, dtype)
    if slot_bytes >= budget:
        raise ValueError(
            f"cache budget {budget} B cannot hold the KDA state of max_num_seqs={config.max_num_seqs} "
            f"requests ({slot_bytes} B); raise the budget or lower max_num_seqs"
        )
    num_pages = (budget - slot_bytes) // page_bytes if page_bytes else 0
    return CacheLayout(page_size=config.page_size, num_pages=int(num_pages), num_slots=num_slots)
