"""Where the padding rows of graph steps point. Both graph paths pad: decode graphs pad the batch to a
captured size (engine/decode_graph), piecewise prefill graphs pad the rows to a token bucket
(engine/prefill_graph); the engine reserves one page and one KDA slot for them at startup, never a request's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PadTargets:
    """Where padding rows point: a page and a KDA slot reserved for them (never a request's)."""

    page: int
    slot: int


__all__ = ["PadTargets"]
