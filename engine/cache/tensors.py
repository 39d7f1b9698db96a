"""The cache tensors themselves: paged KV per attention layer, state slots per KDA layer.

Layouts (canonical: full heads, token order inside a page):
    MLA page     [num_pages, page_size, kv_lora_rank + qk_rope_head_dim]   (normed c_kv | k_pe)
    GQA page     [num_pages, page_size, 2, num_kv_heads, head_dim]         (K | V)
    KDA recurrent[num_slots, heads, K, V]  fp32
    KDA conv     [num_slots, 3 * heads * K, W - 1]  last W-1 pre-conv q|k|v inputs, oldest first
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from engine.model_config import ModelConfig


@dataclass(frozen=True)
class CacheLayout:
    page_size: int
    num_pages: int
    num_slots: int

    def kv_bytes_per_page(self, cfg: ModelConfig, dtype: torch.dtype) -> int:
        return _kv_bytes_per_page(cfg, self.page_size, dtype)


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _kv_bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    per_token = _prod(cfg.kv_entry_shape) * dtype.itemsize
    return per_token * page_size * len(cfg.attention_layers)


def state_bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype) -> int:
    h, k = cfg.kda_num_heads, cfg.kda_head_dim
    recurrent = h * k * k * 4
    conv = 3 * h * k * (cfg.conv_kernel_size - 1) * dtype.itemsize
    return (recurrent + conv) * len(cfg.kda_layers)


class CacheTensors:
    """Per-layer cache storage. ``kv[layer]`` exists for attention layers, ``recurrent`` /
    ``conv[layer]`` for KDA layers (keys are the model's 0-based layer indices). ``layers``: only
    these layers (a pipeline stage holds the caches of the layers it owns)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layout: CacheLayout,
        dtype: torch.dtype,
        device: torch.device,
        layers: Collection[int] | None = None,
    ):
        self.layout = layout
        attn = [i for i in cfg.attention_layers if layers is None or i in layers]
        kda = [i for i in cfg.kda_layers if layers is None or i in layers]
        self.kv: dict[int, torch.Tensor] = {
            i: torch.zeros(layout.num_pages, layout.page_size, *cfg.kv_entry_shape, dtype=dtype, device=device)
            for i in attn
        }
        h, k, w = cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size
        self.recurrent: dict[int, torch.Tensor] = {
            i: torch.zeros(layout.num_slots, h, k, k, dtype=torch.float32, device=device) for i in kda
        }
        self.conv: dict[int, torch.Tensor] = {
            i: torch.zeros(layout.num_slots, 3 * h * k, w - 1, dtype=dtype, device=device) for i in kda
        }

    def reset_slot(self, slot: int) -> None:
        """A fresh request starts from the zero state."""
        for t in self.recurrent.values():
            t[slot].zero_()
        for t in self.conv.values():
            t[slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        for t in (*self.recurrent.values(), *self.conv.values()):
            t[dst].copy_(t[src])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.kv, self.recurrent, self.conv) for t in d.values())
