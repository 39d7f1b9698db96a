"""Choosing the drafter of a decode engine."""

from __future__ import annotations

import torch

from engine.config import SpeculativeConfig
from engine.model_config import ModelConfig
from engine.models.base import CausalLM
from engine.spec.aux_tap import AuxTapDrafter, load_drafter
from engine.spec.ngram import NgramDrafter


def build_drafter(
    spec: SpeculativeConfig, model: CausalLM, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
) -> NgramDrafter | AuxTapDrafter | None:
    if spec.method is None or spec.num_speculative_tokens == 0:
        return None
    if spec.method == "ngram":
        return NgramDrafter(spec.ngram_min, spec.ngram_max)
    drafter = AuxTapDrafter(load_drafter(spec.draft_model, cfg.hidden_size, cfg.vocab_size, dtype, device))
    bad = [t for t in drafter.aux_layer_ids if not -1 <= t < cfg.num_hidden_layers]
    if bad:
        raise ValueError(f"drafter taps {bad} are outside the target's layers -1..{cfg.num_hidden_layers - 1}")
    model.aux_layer_ids = drafter.aux_layer_ids  # the target captures exactly these taps
    return drafter
