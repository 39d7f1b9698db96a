"""Decode worker configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig, SpeculativeConfig
from kvstore.store import PrefixStoreConfig


@dataclass(frozen=True)
class DecodeConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 50062
    metrics_port: int | None = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    drain_seconds: float = 10.0
    prefix_store: PrefixStoreConfig | None = None
    """The shared prefix tier + index; used when engine.enable_prefix_caching is set."""
    reserve_timeout_s: float = 30.0
    """How long a request waits for free pages/slots before RESOURCE_EXHAUSTED."""

    def __post_init__(self) -> None:
        self.engine.parallel.check_service("decode", self.engine.enable_prefix_caching)
