"""Parallel prefill and decode: PCP x PP prefill, TP x PP decode, one process per rank.

``create_engine`` is the entry point; with a single-rank layout it returns today's ``LLMEngine``.
Imports stay lazy here: ``engine.config`` imports ``engine.parallel.config`` at startup.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine


def create_engine(config: EngineConfig) -> LLMEngine:
    if not config.parallel.enabled:
        from engine.llm_engine import LLMEngine

        return LLMEngine(config)
    from engine.parallel.engine import ParallelLLMEngine

    return ParallelLLMEngine(config)
