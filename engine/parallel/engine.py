"""Rank 0 of a parallel engine: the ``LLMEngine`` API (scheduler, sampler, gRPC-facing calls) driving
every rank, one broadcast command per step.

    step():  schedule (rank 0 only)
             -> StepPlan: the ForwardBatch + KDA fork copies + live handoff streams, broadcast
             -> every rank runs its part (engine/parallel/runner.py); rank 0 gets the logits
             -> (P/D) every stage's leader has put its layers' handoff messages in its own stream
             -> later stages send rank 0 the aux taps they own (when a drafter or a handoff reads them)
             -> rank 0 samples or verifies drafts; tokens + accepted counts are broadcast (every rank
                logs the same); a rejected draft's KDA state is dropped by the slot swap rank 0's
                scheduler makes, which every stage follows through the next plan's slot ids
             -> postprocess and file checkpoints (rank 0), after every stage finished the step
"""

from __future__ import annotations

import atexit
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from engine.cache.tensors import CacheLayout, CacheTensors
from engine.config import EngineConfig
from engine.forward_batch import ForwardBatch
from engine.llm_engine import ImportReservation, LLMEngine, RequestOutput, resolve_device
from engine.model_config import load_model_config
from engine.model_runner import ModelRunner
from engine.models.base import CausalLM
from engine.parallel.config import ParallelLayoutError
from engine.parallel.groups import ParallelGroups, rank_device, resolve_backend
from engine.parallel.launcher import RankProcesses, RankState
from engine.parallel.plan import CallCommand, ImportCommand, StepPlan, StopCommand
from engine.parallel.runner import StageRunner
from engine.parallel.stage import build_stage, make_stage_cache, plan_stage_cache
from engine.parallel.stage_stream import StageEndpoint, start_stage_streams
from engine.parallel.transfer import slice_for_rank, staging_cache, write_slice
from engine.request import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import SampleResult, SchedulerOutput

if TYPE_CHECKING:
    from engine.kv_transfer.producer import HandoffProducer

logger = logging.getLogger(__name__)


class ParallelLLMEngine(LLMEngine):
    def __init__(self, config: EngineConfig) -> None:
        p = config.parallel
        p.check_model(load_model_config(config.model))  # refuse before any rank starts (graphs: EngineConfig)
        device = rank_device(resolve_device(config.device), 0)
        backend = resolve_backend(p, device)
        if (backend == "nccl") != (device.type == "cuda"):
            raise ParallelLayoutError(
                f"parallel layout {p.describe()} with backend {backend} on {device.type}: "
                "use gloo on CPU and nccl on CUDA"
            )
        if device.type == "cuda" and torch.cuda.device_count() < p.world_size:
            raise ParallelLayoutError(
                f"parallel layout {p.describe()} needs {p.world_size} GPUs; {torch.cuda.device_count()} visible"
            )
        if torch.distributed.is_initialized():
            raise RuntimeError("one parallel engine per process: close() the other one first")
        self.parallel = p
        self._closed = False
        self._producer: HandoffProducer | None = None
        self._staging: dict[str, CacheTensors] = {}
        self._procs = RankProcesses(config)
        try:
            self.groups = ParallelGroups(p, 0, self._procs.port, device)
            super().__init__(config)
        except BaseException:
            self._procs.kill()
            if hasattr(self, "groups"):
                self.groups.destroy()
            raise
        atexit.register(self.close)
        logger.info(
            "parallel engine %s: %d ranks, rank 0 holds layers %s",
            p.describe(),
            p.world_size,
            list(self.stage.layers),
        )

    # ---- construction: rank 0's share, in the same order as the other ranks (launcher.build_rank) --------
    def _load_model(self) -> CausalLM:
        self.stage = build_stage(self.config, self.model_config, self.groups, self.dtype, self.device)
        return self.stage.model

    def _plan_cache(self) -> CacheLayout:
        return plan_stage_cache(self.config, self.stage, self.groups, self.dtype, self.device)

    def _make_cache(self, layout: CacheLayout) -> CacheTensors:
        return make_stage_cache(self.stage, layout, self.dtype, self.device)

    def _make_runner(self) -> ModelRunner:
        self.stage_runner = StageRunner(self.stage, self.cache, self.groups, self.device)
        self.rank_state = RankState(self.config, self.groups, self.stage, self.cache, self.stage_runner)
        # builds the step's ForwardBatch on the CPU: it is pickled to every rank
        return ModelRunner(self.model, self.cache, torch.device("cpu"), self.config.page_size)

    # ---- the step ----------------------------------------------------------------------------------------
    def _execute(self, sched: SchedulerOutput) -> tuple[dict[str, SampleResult], dict[str, int]]:
        forks = []
        for c in sched.chunks:  # the copy runs on every stage, before the step's kernels
            if c.request.fork_slot is not None:
                forks.append((c.request.fork_slot, c.request.slot_ids[0]))
                self.slots.free([c.request.fork_slot])
                c.request.fork_slot = None
        sampling = [c for c in sched.chunks if c.samples]
        plan = StepPlan(
            batch=self.runner.prepare(sched.chunks),
            forks=forks,
            num_microbatches=self.parallel.num_microbatches,
            num_sampled=len(sampling),
            sample_widths=[1 + len(c.drafts) for c in sampling],
            aux_layer_ids=self.model.aux_layer_ids,
            handoff=self._producer.streams() if self._producer is not None else {},
        )
        logits = self._run_plan(plan)
        sampled, aux_rows = self._sample(sched.chunks, logits)  # verifies drafts as one process does
        if plan.num_sampled:
            results = [sampled[c.request.request_id] for c in sampling]
            self.stage_runner.sync_results([(r.tokens, r.num_accepted) for r in results], plan.sample_widths)
        return sampled, aux_rows

    def _run_plan(self, plan: StepPlan) -> torch.Tensor:
        self.groups.broadcast_command(plan)
        logits = self.stage_runner.run(plan)
        assert logits is not None  # rank 0 samples
        if plan.aux_layer_ids:
            self.model.aux_states = self._gather_taps(plan.aux_layer_ids)
        return logits

    def _gather_taps(self, layer_ids: tuple[int, ...]) -> torch.Tensor:
        """[S, len(layer_ids) * hidden] in the drafter's tap order, from the stages that own each tap."""
        taps = dict(self.stage_runner.taps)
        for stage in range(1, self.parallel.pp):
            taps.update(self.groups.recv_object(self.parallel.rank_of(stage, 0)))
        return torch.cat([taps[t].to(self.device) for t in layer_ids], dim=-1)

    def _score(self, batch: ForwardBatch) -> torch.Tensor:
        return self._run_plan(StepPlan(batch=batch))

    # ---- P/D -----------------------------------------------------------------------------------------------
    def attach_handoff_producer(self, producer: HandoffProducer) -> None:
        self._producer = producer

    def start_stage_streams(self, host: str, advertise_host: str | None = None) -> list[StageEndpoint]:
        """Prefill worker: stages > 0 serve their layers' share of every handoff from their own endpoint."""
        found = self.collective_call(functools.partial(start_stage_streams, host=host, advertise_host=advertise_host))
        return sorted((e for e in found if e is not None), key=lambda e: e.stage)

    def import_target(self, res: ImportReservation) -> tuple[CacheTensors, list[int], list[int]]:
        staging = staging_cache(self.model_config, res.num_prompt_tokens, self.config.page_size, self.dtype)
        self._staging[res.request_id] = staging
        return staging, list(range(staging.layout.num_pages)), [0] if res.slot_ids else []

    def insert_prefilled(
        self,
        res: ImportReservation,
        prompt_ids: list[int],
        params: SamplingParams,
        first_token: int,
        first_logprobs: TokenLogprobs | None,
        cache_salt: str = "",
        aux: torch.Tensor | None = None,
    ) -> RequestOutput:
        staging = self._staging.pop(res.request_id, None)
        if staging is not None and res.request_id in self._reservations:
            self.groups.broadcast_command(ImportCommand(res.request_id))
            for rank in range(self.parallel.world_size):
                share = slice_for_rank(
                    self.config, self.model_config, staging, res.num_prompt_tokens, res.page_ids, res.slot_ids, rank
                )
                if rank == 0:
                    write_slice(self.cache, share)
                else:
                    self.groups.send_object(share, rank)
        return super().insert_prefilled(res, prompt_ids, params, first_token, first_logprobs, cache_salt, aux)

    def release_import(self, res: ImportReservation) -> None:
        self._staging.pop(res.request_id, None)
        super().release_import(res)

    # ---- every rank ----------------------------------------------------------------------------------------
    def collective_call(self, fn: Callable[[RankState], Any]) -> list[Any]:
        """fn(rank state) on every rank (fn must be picklable: a module-level function); results by rank."""
        self.groups.broadcast_command(CallCommand(fn))
        try:
            mine: Any = fn(self.rank_state)
        except Exception as e:  # the other ranks still answer: keep the command channel in step
            mine = e
        out = self.groups.gather_objects(mine)
        assert out is not None
        for rank, result in enumerate(out):
            if isinstance(result, Exception):
                raise RuntimeError(f"collective_call failed on rank {rank}: {result!r}") from result
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if not self._procs.dead():
                self.groups.broadcast_command(StopCommand())
        except Exception as e:  # a rank already gone: make sure the rest go too
            logger.warning("stopping the ranks: %s", e)
            self._procs.kill()
        self._procs.stop()
        self.groups.destroy()
