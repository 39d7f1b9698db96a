"""Prefill worker configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig, SpeculativeConfig
from engine.kv_transfer.lanes import MAX_LANES
from kvstore.store import PrefixStoreConfig


class ProducerSpeculationError(ValueError):
    """A prefill worker was configured to speculate; it never does."""


@dataclass(frozen=True)
class PrefillConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 50061
    metrics_port: int | None = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    drain_seconds: float = 10.0
    prefix_store: PrefixStoreConfig | None = None
    """The shared prefix tier + index; used when engine.enable_prefix_caching is set."""
    max_message_bytes: int = 1 << 20
    max_handoff_lanes: int = 8
    """Most data streams one handoff may be pulled over (PrefillRequest.lanes asks; the header grants)."""
    lane_ttl_s: float = 60.0
    """How long a finished handoff's lanes wait to be pulled before their messages are dropped."""
    advertise_host: str | None = None
    """The address other hosts dial for this worker's stage streams and socket lanes (e.g. a pod's IP);
    default: ``host``, or this machine's hostname when ``host`` is a wildcard."""
    data_port: int | None = 0
    """Serve socket lanes (engine/kv_transfer/socket_lanes.py) on this port of ``host`` (0, the default: any
    free one, advertised in each handoff's header) for consumers that ask for them; None: gRPC lanes only."""

    def __post_init__(self) -> None:
        if self.speculative.enabled:
            spec = self.speculative
            raise ProducerSpeculationError(
                "a prefill worker never speculates: remove the speculative settings "
                f"(method={spec.method!r}, num_speculative_tokens={spec.num_speculative_tokens}, "
                f"draft_model={spec.draft_model!r}); speculative decoding runs on decode workers only"
            )
        self.engine.parallel.check_service("prefill", self.engine.enable_prefix_caching)
        if not 0 < self.max_message_bytes <= 16 << 20:
            raise ValueError(f"max_message_bytes={self.max_message_bytes} must be in (0, 16 MiB]")
        if not 1 <= self.max_handoff_lanes <= MAX_LANES:
            raise ValueError(f"max_handoff_lanes={self.max_handoff_lanes} must be in [1, {MAX_LANES}]")
        if self.data_port is not None and not 0 <= self.data_port < 65536:
            raise ValueError(f"data_port={self.data_port} must be in [0, 65536)")
