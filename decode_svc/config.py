"""Decode worker configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig, SpeculativeConfig
from engine.kv_transfer.lanes import MAX_LANES
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
    handoff_lanes: int = 1
    """Data streams to pull each handoff over, each on its own connection (engine/kv_transfer/lanes.py);
    the prefill worker may grant fewer."""

    handoff_transport: str = "socket"
    """Where lanes 1.. are pulled: "socket" (the prefill worker's socket data plane,
    engine/kv_transfer/socket_lanes.py: every kv / state message on them, at least one lane; a worker without
    one answers with gRPC lanes) or "grpc" (PullLane). Sockets by default: a gRPC-Python receiver reaches a
    third to a half of a raw socket's bytes/s on loopback, the socket lanes 47-111 % on three hosts
    (docs/PERFORMANCE.md)."""

    def __post_init__(self) -> None:
        self.engine.parallel.check_service("decode", self.engine.enable_prefix_caching)
        if not 1 <= self.handoff_lanes <= MAX_LANES:
            raise ValueError(f"handoff_lanes={self.handoff_lanes} must be in [1, {MAX_LANES}]")
        if self.handoff_transport not in ("grpc", "socket"):
            raise ValueError(f"handoff_transport={self.handoff_transport!r} must be 'grpc' or 'socket'")

    @property
    def lanes_to_ask(self) -> int:
        """Socket lanes carry all the data, so they need one besides the Prefill stream."""
        return max(self.handoff_lanes, 2) if self.handoff_transport == "socket" else self.handoff_lanes
