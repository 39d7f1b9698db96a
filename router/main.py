"""`tandem router`: the gateway process (OpenAI HTTP + gRPC API) over registered workers."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Gauge

from engine.model_config import load_model_config
from engine.tokenizer import Tokenizer
from kvstore.index import RedisIndex
from router.grpc_api import RouterService
from router.openai_api import HttpMetrics, build_app, run_http
from router.pd_backend import PDBackend
from router.workers import WorkerRegistry
from tandem.grpc_util import make_server, set_serving
from tandem.rpc import router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


@dataclass(frozen=True)
class RouterConfig:
    model: str
    """Checkpoint directory: tokenizer and chat template (weights are not loaded here)."""
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int | None = 50060
    served_model_name: str | None = None
    worker_wait_s: float = 120.0
    drain_seconds: float = 10.0
    redis_url: str | None = None
    """The prefix index shared with the prefill workers: enables prefix-aware routing."""
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("the router needs at least one --prefill and one --decode worker")


def _router_metrics(registry: WorkerRegistry, backend: PDBackend) -> HttpMetrics:
    """HTTP metrics plus the router's view of each worker's outstanding work and of prefix routing."""
    reg = CollectorRegistry()
    Gauge(
        "tandem_router_prefix_routed", "Requests routed to the worker with a resident prefix", registry=reg
    ).set_function(lambda: backend.routed_by_prefix)
    Gauge(
        "tandem_router_prefix_fallbacks", "Requests routed by load only (no hit or index down)", registry=reg
    ).set_function(lambda: backend.prefix_fallbacks)
    for role in ("prefill", "decode"):
        g = Gauge(f"tandem_router_{role}_outstanding_requests", f"Requests at {role} workers", ["worker"], registry=reg)
        for w in getattr(registry, role):
            g.labels(w.endpoint).set_function(lambda w=w: w.outstanding_requests)
    return HttpMetrics(reg)


async def run_router(config: RouterConfig) -> None:
    tokenizer = Tokenizer(config.model)
    model_cfg = load_model_config(config.model)
    registry = WorkerRegistry()
    for ep in config.prefill:
        await registry.register(ep, "prefill", wait_s=config.worker_wait_s)
    for ep in config.decode:
        await registry.register(ep, "decode", wait_s=config.worker_wait_s)
    name = config.served_model_name or registry.prefill[0].info.model_name
    max_len = registry.max_model_len or model_cfg.max_position_embeddings
    backend = PDBackend(registry, RedisIndex(config.redis_url) if config.redis_url else None)

    app = build_app(backend, tokenizer, name, max_len, metrics=_router_metrics(registry, backend))
    runner = await run_http(app, config.host, config.http_port)

    server, health = None, None
    if config.grpc_port is not None:
        server, health = make_server([SERVICE_NAME])
        router_pb2_grpc.add_RouterServicer_to_server(
            RouterService(backend, tokenizer, model_cfg.vocab_size, max_len), server
        )
        server.add_insecure_port(f"{config.host}:{config.grpc_port}")
        await server.start()
        set_serving(health, [SERVICE_NAME], True)
    url = f"http://{config.host}:{config.http_port}/v1"
    logger.info("router serving %s at %s (gRPC %s)", name, url, config.grpc_port)
    print(f"TANDEM_READY router {url}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if server is not None:
        set_serving(health, [SERVICE_NAME], False)
        await server.stop(grace=config.drain_seconds)
    await runner.cleanup()


def run(config: RouterConfig) -> None:
    asyncio.run(run_router(config))
