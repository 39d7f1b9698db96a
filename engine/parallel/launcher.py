"""Starting the ranks, and the loop every rank but rank 0 runs.

Rank 0 is the engine's own process (the gRPC server, the scheduler, the sampler). It starts ranks
1..world-1 as child processes (``python -m engine.parallel.worker``), which build their stage and then
execute rank 0's commands until it sends ``StopCommand`` or goes away (a child dies with its parent).
"""

from __future__ import annotations

import base64
import logging
import os
import pickle
import socket
import subprocess
import sys
from dataclasses import dataclass

import torch

from engine.cache.tensors import CacheTensors
from engine.config import EngineConfig
from engine.parallel.groups import ParallelGroups
from engine.parallel.plan import CallCommand, ImportCommand, StepPlan, StopCommand
from engine.parallel.runner import StageRunner
from engine.parallel.stage import Stage, build_stage, make_stage_cache, plan_stage_cache
from engine.parallel.stage_stream import StageProducer
from engine.parallel.transfer import write_slice

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankProcesses:
    """Ranks 1..world-1 of one engine, as child processes of rank 0."""

    def __init__(self, config: EngineConfig) -> None:
        self.port = free_port()
        blob = base64.b64encode(pickle.dumps(config)).decode()
        self.procs = [
            subprocess.Popen([sys.executable, "-m", "engine.parallel.worker", str(rank), str(self.port), blob])
            for rank in range(1, config.parallel.world_size)
        ]

    def dead(self) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is not None]

    def stop(self, timeout: float = 10.0) -> None:
        for p in self.procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("rank process %d did not stop in %.0f s: killing it", p.pid, timeout)
                p.kill()
                p.wait()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@dataclass
class RankState:
    """What one rank holds; ``CallCommand`` functions receive it."""

    config: EngineConfig
    groups: ParallelGroups
    stage: Stage
    cache: CacheTensors
    runner: StageRunner
    relay: StageProducer | None = None
    """A prefill stage leader's handoff streams (stages > 0, once the worker started them)."""

    @property
    def rank(self) -> int:
        return self.groups.rank


def build_rank(config: EngineConfig, groups: ParallelGroups, device: torch.device) -> RankState:
    """A non-zero rank's share, built in the same order (same collectives) as rank 0's engine."""
    from engine.loader import resolve_dtype
    from engine.model_config import load_model_config

    cfg = load_model_config(config.model)
    dtype = resolve_dtype(config.dtype, cfg)
    stage = build_stage(config, cfg, groups, dtype, device)
    layout = plan_stage_cache(config, stage, groups, dtype, device)
    cache = make_stage_cache(stage, layout, dtype, device)
    runner = StageRunner(stage, cache, groups, device)
    return RankState(config, groups, stage, cache, runner)


def serve(state: RankState) -> None:
    """Execute rank 0's commands until StopCommand; mirrors ParallelLLMEngine's side of each one."""
    g = state.groups
    while True:
        cmd = g.recv_command()
        if isinstance(cmd, StepPlan):
            if state.relay is not None:
                state.relay.begin(cmd.handoff)
            state.runner.run(cmd)
            if state.relay is not None:
                state.relay.end_step(cmd)
            state.runner.send_taps(cmd)
            if cmd.num_sampled:
                state.runner.sync_results(None, cmd.sample_widths)
        elif isinstance(cmd, ImportCommand):
            write_slice(state.cache, g.recv_object(0))
        elif isinstance(cmd, CallCommand):
            try:
                result = cmd.fn(state)
            except Exception as e:  # reported by rank 0; this rank keeps serving
                result = e
            g.gather_objects(result)
        elif isinstance(cmd, StopCommand):
            if state.relay is not None:
                state.relay.stop()
            return
        else:
            raise RuntimeError(f"rank {g.rank}: unknown command {type(cmd).__name__}")


def cpu_seconds(_state: RankState | None = None) -> float:
    """CPU time this rank's process has used (benchmarks: the busiest rank is the critical path)."""
    import time

    return time.process_time()


def die_with_parent() -> None:
    """A rank must not outlive rank 0 (killed or crashed): ask the kernel to kill us with it."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before prctl took effect
        sys.exit(1)


def worker_main(argv: list[str]) -> int:
    rank, port, blob = int(argv[0]), int(argv[1]), argv[2]
    die_with_parent()
    config: EngineConfig = pickle.loads(base64.b64decode(blob))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    from engine.llm_engine import resolve_device
    from engine.parallel.groups import rank_device

    device = rank_device(resolve_device(config.device), rank)
    if device.type == "cpu":
        torch.set_num_threads(config.cpu_threads)
    groups = ParallelGroups(config.parallel, rank, port, device)
    try:
        serve(build_rank(config, groups, device))
    finally:
        groups.destroy()
    return 0
