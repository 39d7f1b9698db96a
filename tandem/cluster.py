"""A local P/D cluster: router + prefill and decode workers as separate processes on localhost.

Used by `tandem serve` and by the end-to-end tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class WorkerSpec:
    role: str  # 'prefill' | 'decode'
    args: list[str] = field(default_factory=list)
    port: int = 0
    metrics_port: int = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    ready: threading.Event = field(default_factory=threading.Event)
    ready_line: str = ""
    spec: WorkerSpec | None = None


class LocalCluster:
    def __init__(
        self,
        model: str | Path,
        workers: list[WorkerSpec] | None = None,
        router_args: list[str] | None = None,
        http_port: int | None = None,
        grpc_port: int | None = None,
        log_dir: Path | None = None,
        start_router: bool = True,
    ) -> None:
        self.model = str(model)
        self.workers = workers or [WorkerSpec("prefill"), WorkerSpec("decode")]
        self.router_args = router_args or []
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.log_dir = log_dir
        self.start_router = start_router
        self.procs: list[Proc] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def worker(self, role: str, i: int = 0) -> WorkerSpec:
        return [w for w in self.workers if w.role == role][i]

    def _spawn(self, name: str, args: list[str]) -> Proc:
        cmd = [sys.executable, "-m", "tandem.cli", *args]
        err: IO | int | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            err = (self.log_dir / f"{name}.log").open("w")
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONUNBUFFERED": "1"}
        popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        proc = Proc(name, popen)
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()
        self.procs.append(proc)
        return proc

    @staticmethod
    def _pump(proc: Proc) -> None:
        assert proc.popen.stdout is not None
        for line in proc.popen.stdout:
            if line.startswith("TANDEM_READY") and not proc.ready.is_set():
                proc.ready_line = line.strip()
                proc.ready.set()
            else:
                sys.stdout.write(line)

    def start_worker(self, w: WorkerSpec) -> Proc:
        # port 0: the worker binds a free port itself and reports it (no pick-then-bind race)
        args = [w.role, "--model", self.model, "--port", str(w.port), "--metrics-port", str(w.metrics_port), *w.args]
        proc = self._spawn(f"{w.role}-{len(self.procs)}", args)
        proc.spec = w
        return proc

    def start(self, timeout: float = 180.0) -> LocalCluster:
        workers = [self.start_worker(w) for w in self.workers]
        self._wait(workers, timeout)
        for p in workers:  # "TANDEM_READY <role> <host>:<port> metrics=<port>"
            _, _, addr, metrics = p.ready_line.split()
            p.spec.port = int(addr.rsplit(":", 1)[1])
            p.spec.metrics_port = int(metrics.split("=", 1)[1])
        if self.start_router:
            self.router([(w.role, w.endpoint) for w in self.workers], timeout)
        return self

    def router(self, endpoints: list[tuple[str, str]], timeout: float = 180.0) -> Proc:
        """Start a router over ``endpoints`` ((role, host:port) pairs) on this cluster's HTTP / gRPC ports.
        Those were picked free earlier; another socket may have taken one since (an outgoing connection's
        ephemeral port): then fresh ports, up to three attempts."""
        for attempt in range(3):
            args = ["router", "--model", self.model, "--http-port", str(self.http_port)]
            args += ["--grpc-port", str(self.grpc_port)]
            for role, endpoint in endpoints:
                args += [f"--{role}", endpoint]
            router = self._spawn("router", args + self.router_args)
            try:
                self._wait([router], timeout, stop_on_failure=False)
                return router
            except RuntimeError:
                self.procs.remove(router)
                if attempt == 2:
                    self.stop()
                    raise
                self.http_port, self.grpc_port = free_port(), free_port()
        raise AssertionError("unreachable")

    def _wait(self, procs: list[Proc], timeout: float, stop_on_failure: bool = True) -> None:
        deadline = time.monotonic() + timeout
        for p in procs:
            while not p.ready.wait(0.1):
                if p.popen.poll() is not None:
                    if stop_on_failure:
                        self.stop()
                    raise RuntimeError(f"{p.name} exited with code {p.popen.returncode} before it was ready")
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"{p.name} not ready after {timeout} s")

    def stop(self, timeout: float = 15.0) -> None:
        for p in reversed(self.procs):
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.popen.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
        self.procs.clear()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
