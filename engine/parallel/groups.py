"""Process groups of one parallel engine and the few collectives the engine uses.

cmd    all ranks, gloo, no practical timeout: rank 0's commands (idle ranks wait here)
cpu    all ranks, gloo: objects (handoff relay, imports, test calls)
world  all ranks, the device backend: stage-boundary sends, the sampled-id broadcast
inner  the ranks of this rank's stage (PCP or TP group), the device backend: gathers, all-reduces
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

from engine.parallel.config import ParallelConfig

logger = logging.getLogger(__name__)
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a server may sit idle between requests for as long as it likes
STEP_TIMEOUT = datetime.timedelta(minutes=10)


def resolve_backend(config: ParallelConfig, device: torch.device) -> str:
    if config.backend != "auto":
        return config.backend
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One GPU per rank on a single host; CPU ranks share the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


class ParallelGroups:
    def __init__(self, config: ParallelConfig, rank: int, port: int, device: torch.device) -> None:
        self.config = config
        self.rank = rank
        self.world_size = config.world_size
        self.device = device
        self.stage = config.stage_of(rank)
        self.inner_rank = config.inner_rank_of(rank)
        self.inner_size = config.inner
        backend = resolve_backend(config, device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=config.startup_timeout_s),
        )
        everyone = list(range(self.world_size))
        self.cmd = dist.new_group(everyone, timeout=IDLE_TIMEOUT, backend="gloo")
        self.cpu = dist.new_group(everyone, timeout=STEP_TIMEOUT, backend="gloo")
        self.world = dist.new_group(everyone, timeout=STEP_TIMEOUT, backend=backend)
        self.inner: dist.ProcessGroup | None = None
        for stage in range(config.pp):  # every rank creates every group, in the same order
            members = [config.rank_of(stage, i) for i in range(config.inner)]
            group = dist.new_group(members, timeout=STEP_TIMEOUT, backend=backend)
            if stage == self.stage:
                self.inner = group

    # ---- where this rank sits ----------------------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.config.pp - 1

    @property
    def prev_rank(self) -> int:
        return self.config.rank_of(self.stage - 1, self.inner_rank)

    @property
    def next_rank(self) -> int:
        return self.config.rank_of(self.stage + 1, self.inner_rank)

    @property
    def last_leader(self) -> int:
        """The last stage's inner rank 0: it sends the logits to rank 0 (the sampler)."""
        return self.config.rank_of(self.config.pp - 1, 0)

    @property
    def is_stage_leader(self) -> bool:
        return self.inner_rank == 0

    # ---- commands (rank 0 -> everyone) --------------------------------------------------------------
    def broadcast_command(self, cmd: Any) -> None:
        dist.broadcast_object_list([cmd], src=0, group=self.cmd)

    def recv_command(self) -> Any:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.cmd)
        return box[0]

    def send_object(self, obj: Any, dst: int) -> None:
        dist.send_object_list([obj], dst=dst, group=self.cpu)

    def recv_object(self, src: int) -> Any:
        box: list[Any] = [None]
        dist.recv_object_list(box, src=src, group=self.cpu)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's obj on rank 0 (None elsewhere)."""
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.cpu)
        return out

    # ---- the stage's PCP / TP group -------------------------------------------------------------------
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] on each inner rank -> [inner, n, ...] in inner-rank order."""
        if self.inner_size == 1:
            return x[None]
        out = x.new_empty(self.inner_size * x.shape[0], *x.shape[1:])
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13 lacks the first
        gather(out, x.contiguous(), group=self.inner)
        return out.view(self.inner_size, *x.shape)

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows of x, send_counts[r] of them to inner rank r in order -> the rows every rank sent here,
        recv_counts[r] from rank r, in inner-rank order."""
        if self.inner_size == 1:
            return x
        out = x.new_empty(sum(recv_counts), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.inner)
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.inner_size > 1:
            dist.all_reduce(x, group=self.inner)
        return x

    # ---- stage boundary and the sampled ids ---------------------------------------------------------
    def isend(self, t: torch.Tensor, dst: int) -> dist.Work:
        return dist.isend(t.contiguous(), dst=dst, group=self.world)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(t, src=src, group=self.world)
        return t

    def broadcast_ids(self, ids: torch.Tensor | None, n: int) -> torch.Tensor:
        """The sampling rank's ids [n] to every rank."""
        buf = ids.to(self.device) if ids is not None else torch.empty(n, dtype=torch.int64, device=self.device)
        dist.broadcast(buf, src=0, group=self.world)
        return buf.cpu()

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
