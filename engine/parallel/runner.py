"""One rank's part of every step. The same code runs on rank 0 (called by the engine) and on the
other ranks (called by their command loop), so all ranks take the same path through every collective.

    for each microbatch (pipeline stages overlap on different microbatches):
        stage input   first stage: embed this rank's rows; later stages: receive them from stage - 1
        layers        this stage's layers (TP all-reduces and PCP gathers happen inside them)
        stage output  not last: send the hidden states (the residual stream: our layers keep it in
                      ``h``, nothing else crosses) to stage + 1; last: logits of the sampling rows
    last stage's leader -> rank 0: "step done" (+ the logits), every step; so rank 0 files KDA
    checkpoints (and anything else) only after every stage has written this step's state
    rank 0 samples; its ids are broadcast to every rank (``sync_ids``) on every step that samples
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from engine.cache.tensors import CacheTensors
from engine.forward_batch import ForwardBatch
from engine.parallel.groups import ParallelGroups
from engine.parallel.pcp import PCPForwardBatch, localize
from engine.parallel.plan import StepPlan, split_batch, to_device
from engine.parallel.stage import Stage

EMITTED_LOG = 4096

LogitsHook = Callable[[torch.Tensor], torch.Tensor]


class StageRunner:
    def __init__(self, stage: Stage, cache: CacheTensors, groups: ParallelGroups, device: torch.device) -> None:
        self.stage = stage
        self.model = stage.model
        self.cache = cache
        self.groups = groups
        self.device = device
        cfg = stage.local_cfg
        self.hidden_size, self.vocab_size = cfg.hidden_size, cfg.vocab_size
        self.dtype = next(self.model.parameters()).dtype
        self.pcp = groups.config.pcp > 1
        self.emitted: deque[int] = deque(maxlen=EMITTED_LOG)
        """The ids rank 0 sampled, as this rank received them (the last EMITTED_LOG)."""
        self.logits_hooks: list[LogitsHook] = []
        """Applied to this rank's logits before they go to the sampler (tests perturb them here)."""

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor | None:
        """This rank's part of the step. Returns the logits [S, V] fp32 on rank 0, None elsewhere."""
        for src, dst in plan.forks:  # every stage forks its own KDA layers' state (no-op without any)
            self.cache.copy_slot(src, dst)
        batch = to_device(plan.batch, self.device)
        in_flight: list[tuple[torch.distributed.Work, torch.Tensor]] = []
        parts: list[torch.Tensor] = []
        for mb in split_batch(batch, plan.num_microbatches):
            local = localize(mb, self.groups) if self.pcp else mb
            h = self._stage_input(local)
            for i in self.stage.layers:
                h = self.model.model.layers[i](h, local, self.cache, self.model.backends)
                for hook in self.model.layer_hooks:
                    hook(i, mb)
            if not self.groups.is_last_stage:
                in_flight.append((self.groups.isend(h, self.groups.next_rank), h))
            elif mb.logits_indices.numel():
                parts.append(self._logits(h, local, mb))
        for work, _ in in_flight:
            work.wait()
        return self._to_sampler(parts, batch)

    def _stage_input(self, local: ForwardBatch) -> torch.Tensor:
        if self.groups.is_first_stage:
            return self.model.model.embed_tokens(local.input_ids)
        rows = local.rows.local_rows if isinstance(local, PCPForwardBatch) and local.rows else local.num_tokens
        return self.groups.recv((rows, self.hidden_size), self.dtype, self.groups.prev_rank)

    def _logits(self, h: torch.Tensor, local: ForwardBatch, mb: ForwardBatch) -> torch.Tensor:
        idx = mb.logits_indices
        if isinstance(local, PCPForwardBatch) and local.rows is not None:
            # each sampling row lives on one PCP rank: every rank fills its own, all-gather, pick the owner's
            size, rank = local.rows.size, local.rows.rank
            buf = h.new_zeros(idx.numel(), h.shape[1])
            mine = idx % size == rank
            buf[mine] = h[idx[mine] // size]
            rows = self.groups.all_gather(buf)[idx % size, torch.arange(idx.numel(), device=h.device)]
        else:
            rows = h[idx]
        logits = self.model.lm_head(self.model.model.norm(rows)).float()
        if self.stage.tp.shard_lm_head:  # [tp, S, V / tp] -> [S, V]
            logits = self.groups.all_gather(logits).permute(1, 0, 2).reshape(idx.numel(), -1)
        for hook in self.logits_hooks:
            logits = hook(logits)
        return logits

    def _to_sampler(self, parts: list[torch.Tensor], batch: ForwardBatch) -> torch.Tensor | None:
        g = self.groups
        s = batch.logits_indices.numel()
        logits = torch.cat(parts) if parts else torch.empty(0, self.vocab_size, device=self.device)
        if g.rank == 0:
            if g.is_last_stage:
                return logits
            g.recv((1,), torch.int64, g.last_leader)  # "step done": every stage has finished this step
            return g.recv((s, self.vocab_size), torch.float32, g.last_leader) if s else logits
        if g.rank == g.last_leader:
            g.isend(torch.tensor([s], dtype=torch.int64, device=self.device), 0).wait()
            if s:
                g.isend(logits, 0).wait()
        return None

    def sync_ids(self, ids: list[int] | None, n: int) -> list[int]:
        """Rank 0 passes the ids it sampled; every rank returns (and logs) exactly those ids. Called on
        every step whose plan samples (``plan.num_sampled``), on every rank: one predicate, no drift."""
        sent = torch.tensor(ids, dtype=torch.int64) if ids is not None else None
        got = self.groups.broadcast_ids(sent, n).tolist()
        self.emitted.extend(got)
        return got
