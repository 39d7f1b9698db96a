"""Prometheus metrics of a worker, served on its own /metrics port."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class WorkerMetrics:
    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r, p = self.registry, f"tandem_{role}"
        self.prefix = p
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
        self.lane_streams = Counter(
            f"{p}_lane_streams",
            "Handoff lanes served by transport (grpc: PullLane, socket: the data plane) and outcome",
            ["transport", "outcome"],
            registry=r,
        )
        self.lanes_held = Gauge(f"{p}_handoffs_with_lanes", "Handoffs whose lanes are held for pulling", registry=r)
        self.pages_in_use = Gauge(f"{p}_pages_in_use", "KV pages allocated", registry=r)
        self.slots_in_use = Gauge(f"{p}_slots_in_use", "KDA state slots allocated", registry=r)
        self.outstanding = Gauge(f"{p}_outstanding_requests", "Requests held by the engine", registry=r)
        self.spec_drafted = Counter(f"{p}_spec_draft_tokens", "Draft tokens proposed", registry=r)
        self.spec_accepted = Counter(f"{p}_spec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.spec_verify_steps = Counter(f"{p}_spec_verify_steps", "Verify steps", registry=r)
        self.spec_acceptance = Histogram(
            f"{p}_spec_acceptance_rate",
            "Per-request share of drafts accepted",
            buckets=(0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0),
            registry=r,
        )
        self.spec_accepted_length = Histogram(
            f"{p}_spec_mean_accepted_length",
            "Per-request tokens emitted per verify step (accepted drafts + 1)",
            buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8),
            registry=r,
        )

    def track_engine(self, pages: Callable[[], float], slots: Callable[[], float], outstanding: Callable[[], float]):
        self.pages_in_use.set_function(pages)
        self.slots_in_use.set_function(slots)
        self.outstanding.set_function(outstanding)

    def track_graphs(self, runner) -> None:
        """Steps through the static decode path and the piecewise prefill path (engine/decode_graph,
        engine/prefill_graph), replayed from CUDA graphs or run eagerly (the host), read at scrape time."""
        steps = Gauge(
            f"{self.prefix}_graph_steps",
            "Steps on the graph paths, by path and how they ran",
            ["graphs", "run"],
            registry=self.registry,
        )
        for name, attr, eager in (
            ("decode", "decode_graphs", "eager_static_steps"),
            ("prefill", "prefill_graphs", "eager_padded_steps"),
        ):
            graphs = getattr(runner, attr, None)
            if graphs is None:
                continue
            for run, key in (("replayed", "graph_steps"), ("eager", eager)):
                steps.labels(name, run).set_function(lambda graphs=graphs, key=key: graphs.counts[key])

    def track_prefix(self, engine, store) -> None:
        """Prefix-cache hits (device and tier) and the tier's health, read at scrape time."""
        r, p = self.registry, self.prefix
        prefix = engine.prefix_cache
        Gauge(f"{p}_prefix_query_tokens", "Tokens of admitted requests looked up", registry=r).set_function(
            lambda: prefix.queried_tokens
        )
        Gauge(f"{p}_prefix_hit_tokens", "Prompt tokens whose KV was reused", registry=r).set_function(
            lambda: prefix.hit_tokens
        )
        Gauge(f"{p}_prefix_resume_tokens", "Sum of positions where computation resumed", registry=r).set_function(
            lambda: prefix.resume_tokens
        )
        for key, doc in (
            ("tier_hit_tokens", "Prompt tokens loaded from the tier"),
            ("device_hit_tokens", "Prompt tokens already resident on this device at load time"),
            ("loaded_bytes", "Bytes loaded from the tier"),
            ("filed_bytes", "Bytes filed to the tier"),
            ("index_errors", "Index (Redis) failures, served without hits"),
            ("tier_errors", "Tier failures, served without hits"),
            ("corrupt_entries", "Tier entries that failed their checksum and were dropped"),
            ("tier_evictions", "Tier entries evicted (and removed from the index)"),
        ):
            Gauge(f"{p}_{key}", doc, registry=r).set_function(lambda key=key: store.counters[key])
        Gauge(f"{p}_tier_bytes", "Bytes this worker holds in the tier", registry=r).set_function(
            lambda: store.tier.bytes
        )

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics; port 0 picks a free one. Returns the bound port."""
        httpd, _ = start_http_server(port, addr=host, registry=self.registry)
        return httpd.server_port
