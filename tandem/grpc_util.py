"""gRPC plumbing shared by the services: server with health + reflection, client channels that
notice a dead peer within seconds, graceful drain."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20
# Keepalive pings detect a peer that vanished without closing its socket (host down, partition):
# ping every 2 s, give up after 3 s of silence. A killed process is noticed at once (RST).
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
SERVER_OPTIONS = [
    *KEEPALIVE_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
]


def make_server(service_names: Iterable[str]) -> tuple[grpc.aio.Server, health.HealthServicer]:
    server = grpc.aio.server(options=SERVER_OPTIONS)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    return server, health_servicer


def set_serving(health_servicer: health.HealthServicer, services: Iterable[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *services]:
        health_servicer.set(name, status)


def advertised_endpoint(bind_host: str, port: int, advertise_host: str | None = None) -> str:
    """host:port for peers to dial a listener bound on ``bind_host``: ``advertise_host`` when given (e.g. a
    pod's IP), else the bind address, and for a wildcard bind this machine's hostname (stage streams and
    socket lanes are dialled from other hosts); IPv6 literals bracketed."""
    import socket

    host = advertise_host or (socket.gethostname() if bind_host in ("0.0.0.0", "::", "[::]", "") else bind_host)
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def channel(endpoint: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(endpoint, options=KEEPALIVE_OPTIONS)


def own_connection_channel(endpoint: str) -> grpc.aio.Channel:
    """A channel that does not share its connection with other channels to the same endpoint (gRPC
    pools connections process-wide by default)."""
    return grpc.aio.insecure_channel(endpoint, options=[*KEEPALIVE_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])


async def serve_until_signal(
    server: grpc.aio.Server,
    health_servicer: health.HealthServicer,
    services: Iterable[str],
    drain_seconds: float,
) -> None:
    """Serve until SIGINT/SIGTERM, then drain: report NOT_SERVING, let live RPCs finish
    (up to drain_seconds), refuse new ones."""
    services = list(services)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    set_serving(health_servicer, services, True)
    await stop.wait()
    logger.info("draining (up to %.0f s)", drain_seconds)
    set_serving(health_servicer, services, False)
    await server.stop(grace=drain_seconds)
