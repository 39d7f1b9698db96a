"""`tandem prefill`: one prefill worker."""

from __future__ import annotations

import asyncio

from engine.kv_transfer.wire import add_prefill_servicer
from prefill_svc.config import PrefillConfig
from prefill_svc.service import PrefillService
from tandem.rpc import prefill_pb2
from tandem.worker import run_worker

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


def run(config: PrefillConfig) -> None:
    asyncio.run(
        run_worker(
            "prefill",
            config.engine,
            config.host,
            config.port,
            config.metrics_port,
            config.drain_seconds,
            SERVICE_NAME,
            add_prefill_servicer,  # sends the producer's serialized messages as they are
            lambda ae, fp, m, name, store: PrefillService(config, ae, fp, m, name, store),
            config.prefix_store,
        )
    )
