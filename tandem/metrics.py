"""Prometheus metrics of a worker, served on its own /metrics port."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class WorkerMetrics:
    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r, p = self.registry, f"tandem_{role}"
        self.requests = Counter(f"{p}_requests", "Requests by outcome", ["outcome"], registry=r)
        self.ttft = Histogram(f"{p}_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(
            f"{p}_tpot_seconds", "Time per output token after the first", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.transfer_bytes = Counter(f"{p}_transfer_bytes", "Handoff payload bytes", registry=r)
        self.transfer_seconds = Histogram(
            f"{p}_transfer_seconds", "Handoff duration, first to last message", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.live_transfers = Gauge(f"{p}_live_transfers", "Handoffs in progress", registry=r)
        self.pages_in_use = Gauge(f"{p}_pages_in_use", "KV pages allocated", registry=r)
        self.slots_in_use = Gauge(f"{p}_slots_in_use", "KDA state slots allocated", registry=r)
        self.outstanding = Gauge(f"{p}_outstanding_requests", "Requests held by the engine", registry=r)

    def track_engine(self, pages: Callable[[], float], slots: Callable[[], float], outstanding: Callable[[], float]):
        self.pages_in_use.set_function(pages)
        self.slots_in_use.set_function(slots)
        self.outstanding.set_function(outstanding)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)
