"""Start a worker process: engine on its thread, gRPC server, metrics, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.fingerprint import Fingerprint, compute_fingerprint
from engine.parallel import create_engine
from kvstore.store import PrefixStore, PrefixStoreConfig
from tandem.grpc_util import make_server, serve_until_signal
from tandem.malloc import tune_malloc
from tandem.metrics import WorkerMetrics

logger = logging.getLogger(__name__)


def model_name_of(engine_config: EngineConfig) -> str:
    return Path(engine_config.model).resolve().name


async def run_worker(
    role: str,
    engine_config: EngineConfig,
    host: str,
    port: int,
    metrics_port: int | None,
    drain_seconds: float,
    service_name: str,
    add_service: Callable[[object, object], None],
    build_service: Callable[[AsyncEngine, Fingerprint, WorkerMetrics, str, PrefixStore | None], object],
    prefix_store: PrefixStoreConfig | None = None,
) -> None:
    tune_malloc()
    engine = create_engine(engine_config)
    fingerprint = compute_fingerprint(engine_config.model, engine.model_config, engine.dtype, engine_config.page_size)
    metrics = WorkerMetrics(role)
    metrics.track_engine(
        lambda: engine.pages_in_use,
        lambda: engine.slots_in_use,
        lambda: engine.num_outstanding,
    )
    if getattr(engine, "runner", None) is not None:  # a single-rank engine (a parallel one has no graphs)
        metrics.track_graphs(engine.runner)
    # bind first: port 0 picks a free port, and the bound address names this worker in the index
    server, health = make_server([service_name])
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"{role}: cannot bind {host}:{port}")
    if metrics_port is not None:
        metrics_port = metrics.serve(metrics_port, host)
    store = None
    if engine_config.enable_prefix_caching:
        cfg = prefix_store or PrefixStoreConfig()
        if cfg.instance_id is None:
            cfg = dataclasses.replace(cfg, instance_id=f"{host}:{bound}")
        store = PrefixStore(cfg, engine, fingerprint.model_digest[:16])
        metrics.track_prefix(engine, store)
    aengine = AsyncEngine(engine, asyncio.get_running_loop())
    service = build_service(aengine, fingerprint, metrics, model_name_of(engine_config), store)
    add_service(service, server)
    if engine_config.cuda_graphs and engine_config.capture_graphs_at_start and hasattr(engine, "capture_graphs"):
        # after the service: the prefill service's producer hook must be in the pieces it captures
        t0 = time.perf_counter()
        captured = engine.capture_graphs()
        logger.info("%s: %d prefill graph buckets captured in %.1f s", role, captured, time.perf_counter() - t0)
    aengine.start()
    await server.start()
    logger.info(
        "%s worker on %s:%d (metrics %s), fingerprint %s", role, host, bound, metrics_port, fingerprint.digest[:16]
    )
    print(f"TANDEM_READY {role} {host}:{bound} metrics={metrics_port}", flush=True)
    try:
        await serve_until_signal(server, health, [service_name], drain_seconds)
    finally:
        aengine.stop()
        if store is not None:
            store.close()
        engine.close()
