"""`tandem decode`: one decode worker."""

from __future__ import annotations

import asyncio

from decode_svc.config import DecodeConfig
from decode_svc.service import DecodeService
from tandem.rpc import decode_pb2, decode_pb2_grpc
from tandem.worker import run_worker

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


def run(config: DecodeConfig) -> None:
    asyncio.run(
        run_worker(
            "decode",
            config.engine,
            config.host,
            config.port,
            config.metrics_port,
            config.drain_seconds,
            SERVICE_NAME,
            decode_pb2_grpc.add_DecodeServicer_to_server,
            lambda ae, fp, m, name, store: DecodeService(config, ae, fp, m, name, store),
            config.prefix_store,
        )
    )
