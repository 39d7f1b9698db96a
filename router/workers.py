"""Role-aware registry of prefill and decode workers, and selection by least outstanding work."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from tandem.grpc_util import channel
from tandem.rpc import common_pb2 as cpb
from tandem.rpc import decode_pb2_grpc, prefill_pb2_grpc

logger = logging.getLogger(__name__)

ROLE_NAMES = {cpb.PREFILL: "prefill", cpb.DECODE: "decode"}


class RegistrationError(ValueError):
    pass


@dataclass
class Worker:
    endpoint: str
    role: str
    info: cpb.WorkerInfo
    stub: object
    outstanding_requests: int = 0
    outstanding_tokens: int = 0


def check_worker_info(endpoint: str, role: str, info: cpb.WorkerInfo) -> None:
    """The registration rules; raises RegistrationError naming the worker."""
    reported = ROLE_NAMES.get(info.role, "unknown")
    if reported != role:
        raise RegistrationError(f"worker {endpoint} was registered as {role} but reports role {reported}")
    if role == "prefill" and (info.speculative or info.num_speculative_tokens or info.speculative_method):
        raise RegistrationError(
            f"refusing prefill worker {endpoint}: it reports speculative decoding "
            f"(method={info.speculative_method!r}, num_speculative_tokens={info.num_speculative_tokens}); "
            "a producer never speculates"
        )


class WorkerRegistry:
    def __init__(self) -> None:
        self.prefill: list[Worker] = []
        self.decode: list[Worker] = []
        self.fingerprint: str | None = None
        self.max_model_len: int | None = None

    async def register(self, endpoint: str, role: str, wait_s: float = 0.0) -> Worker:
        if role not in ("prefill", "decode"):
            raise RegistrationError(f"unknown role {role!r}")
        ch = channel(endpoint)
        stub = (prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub)(ch)
        info = await _info_with_retry(stub, endpoint, wait_s)
        check_worker_info(endpoint, role, info)
        digest = info.fingerprint.digest
        if self.fingerprint is not None and digest != self.fingerprint:
            raise RegistrationError(
                f"worker {endpoint} serves a different model/layout (fingerprint {digest[:16]}) "
                f"than the registered workers ({self.fingerprint[:16]})"
            )
        self.fingerprint = digest
        self.max_model_len = min(self.max_model_len or info.max_model_len, info.max_model_len)
        worker = Worker(endpoint, role, info, stub)
        (self.prefill if role == "prefill" else self.decode).append(worker)
        logger.info("registered %s worker %s (model %s)", role, endpoint, info.model_name)
        return worker

    def pick_prefill(self) -> Worker:
        if not self.prefill:
            raise RegistrationError("no prefill workers registered")
        return min(self.prefill, key=lambda w: (w.outstanding_tokens, w.outstanding_requests))

    def pick_decode(self) -> Worker:
        if not self.decode:
            raise RegistrationError("no decode workers registered")
        return min(self.decode, key=lambda w: w.outstanding_requests)


async def _info_with_retry(stub, endpoint: str, wait_s: float) -> cpb.WorkerInfo:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await stub.Info(cpb.WorkerInfoRequest(), timeout=5)
        except grpc.aio.AioRpcError as e:
            if time.monotonic() >= deadline:
                raise RegistrationError(f"worker {endpoint} is not reachable: {e.code().name}: {e.details()}") from e
            await asyncio.sleep(0.2)
