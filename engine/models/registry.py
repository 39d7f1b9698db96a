"""Model family -> model class."""

from __future__ import annotations

from engine.model_config import ModelConfig
from engine.models.base import CausalLM
from engine.models.kimi_linear import KimiLinearForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "kimi_linear": KimiLinearForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def build_model(cfg: ModelConfig) -> CausalLM:
    return MODEL_CLASSES[cfg.family](cfg)
