"""One rank's part of every step. The same code runs on rank 0 (called by the engine) and on the
other ranks (called by their command loop), so all ranks take the same path through every collective.

    for each microbatch (pipeline stages overlap on different microbatches):
        stage input   first stage: embed this rank's rows; later stages: receive them from stage - 1
        layers        this stage's layers (TP all-reduces and PCP gathers happen inside them)
        stage output  not last: send the hidden states (the residual stream: our layers keep it in
                      ``h``, nothing else crosses) to stage + 1; last: logits of the sampling rows
    last stage's leader -> rank 0: "step done" (+ the logits), every step; so rank 0 files KDA
    checkpoints (and anything else) only after every stage has written this step's state
    later stages' leaders -> rank 0: the aux taps they own (a drafter's inputs), when the plan asks
    rank 0 samples or verifies drafts; its tokens and accepted counts are broadcast to every rank
    (``sync_results``) on every step that samples
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from engine.cache.tensors import CacheTensors
from engine.forward_batch import ForwardBatch
from engine.models.layers import layer_output
from engine.parallel.groups import ParallelGroups
from engine.parallel.pcp import PCPForwardBatch, localize
from engine.parallel.plan import StepPlan, split_batch, to_device
from engine.parallel.profiling import StepProfiler
from engine.parallel.stage import Stage
from kernels.upload import upload

EMITTED_LOG = 4096

LogitsHook = Callable[[torch.Tensor], torch.Tensor]
Settled = tuple[list[int], int]
"""One sampled request's outcome: the tokens it emitted and how many of its drafts were accepted."""


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
        self.accepted: deque[int] = deque(maxlen=EMITTED_LOG)
        """Accepted drafts per sampled request (0 without drafts), as rank 0 settled them."""
        self.taps: dict[int, torch.Tensor] = {}
        self.profiler = StepProfiler(groups.rank)
        self.logits_hooks: list[LogitsHook] = []
        """Applied to this rank's logits before they go to the sampler (tests perturb them here)."""

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> torch.Tensor | None:
        """This rank's part of the step. Returns the logits [S, V] fp32 on rank 0, None elsewhere; the
        taps this stage owns (of ``plan.aux_layer_ids``) at the logits rows are left in ``self.taps``."""
        with self.profiler.step(plan.batch.num_tokens):
            return self._run(plan)

    def _run(self, plan: StepPlan) -> torch.Tensor | None:
        for src, dst in plan.forks:  # every stage forks its own KDA layers' state (no-op without any)
            self.cache.copy_slot(src, dst)
        batch = plan.batch  # host tensors: pieces are cut on the host, each moved to the device
        own_taps = [t for t in plan.aux_layer_ids if t in self.stage.layers or (t == -1 and self.groups.is_first_stage)]
        captured: dict[int, list[torch.Tensor]] = {t: [] for t in own_taps}
        in_flight: list[tuple[torch.distributed.Work, torch.Tensor]] = []
        parts: list[torch.Tensor] = []
        for mb_host in split_batch(batch, plan.num_microbatches):
            mb = to_device(mb_host, self.device)
            local = localize(mb, self.groups) if self.pcp else mb
            h, residual = self._stage_input(local), None
            if -1 in captured:
                captured[-1].append(self._rows(h, local, mb_host))
            for i in self.stage.layers:
                h, residual, _ = self.model.model.layers[i](h, residual, local, self.cache, self.model.backends)
                if i in captured:
                    captured[i].append(self._rows(layer_output(h, residual), local, mb_host))
                for hook in self.model.layer_hooks:
                    hook(i, mb)
            h = layer_output(h, residual)  # what the next stage receives, and the final norm's input here
            if not self.groups.is_last_stage:
                in_flight.append((self.groups.isend(h, self.groups.next_rank), h))
            elif mb.logits_indices.numel():
                parts.append(self._logits(self._rows(h, local, mb_host)))
        for work, _ in in_flight:
            work.wait()
        self.taps = {t: torch.cat(rows) for t, rows in captured.items()}
        return self._to_sampler(parts, batch)

    def _stage_input(self, local: ForwardBatch) -> torch.Tensor:
        if self.groups.is_first_stage:
            return self.model.model.embed_tokens(local.input_ids)
        rows = local.rows.local_rows if isinstance(local, PCPForwardBatch) and local.rows else local.num_tokens
        return self.groups.recv((rows, self.hidden_size), self.dtype, self.groups.prev_rank)

    def _rows(self, h: torch.Tensor, local: ForwardBatch, mb_host: ForwardBatch) -> torch.Tensor:
        """h at the microbatch's logits rows [S, H], on every rank of the stage (index arithmetic on the
        host copy of the rows: a boolean mask on the device would make the host wait for the forward)."""
        idx = mb_host.logits_indices
        if isinstance(local, PCPForwardBatch) and local.rows is not None:
            # each sampling row lives on one PCP rank: every rank fills its own, all-gather, pick the owner's
            size, rank = local.rows.size, local.rows.rank
            mine = (idx % size == rank).nonzero()[:, 0]
            dev = upload(torch.cat([mine, idx[mine] // size, idx % size]), h.device)
            n = mine.numel()
            buf = h.new_zeros(idx.numel(), h.shape[1])
            buf[dev[:n]] = h[dev[n : 2 * n]]
            return self.groups.all_gather(buf)[dev[2 * n :], torch.arange(idx.numel(), device=h.device)]
        return h[upload(idx, h.device)]

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(self.model.model.norm(rows, self.model.backends)).float()
        if self.stage.tp.shard_lm_head:  # [tp, S, V / tp] -> [S, V]
            logits = self.groups.all_gather(logits).permute(1, 0, 2).reshape(rows.shape[0], -1)
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

    def sync_results(self, results: list[Settled] | None, widths: list[int]) -> list[Settled]:
        """Rank 0 passes (tokens, accepted drafts) per sampled request; every rank returns (and logs)
        exactly those. ``widths`` (from the plan) bounds each request's tokens, so every rank knows the
        message size: one predicate (``plan.num_sampled``), no drift. Stages that do not sample learn
        here how many drafts each verify step kept."""
        n = sum(1 + w for w in widths)
        sent = None
        if results is not None:
            flat: list[int] = []
            for (tokens, accepted), w in zip(results, widths, strict=True):
                flat += [accepted, *tokens, *[-1] * (w - len(tokens))]
            sent = torch.tensor(flat, dtype=torch.int64)
        got = self.groups.broadcast_ids(sent, n).tolist()
        out, at = [], 0
        for w in widths:
            accepted, tokens = got[at], [t for t in got[at + 1 : at + 1 + w] if t >= 0]
            out.append((tokens, accepted))
            self.emitted.extend(tokens)
            self.accepted.append(accepted)
            at += 1 + w
        return out

    def send_taps(self, plan: StepPlan) -> None:
        """A later stage's leader: its taps to rank 0 (which captured stage 0's itself)."""
        if plan.aux_layer_ids and self.groups.is_stage_leader and not self.groups.is_first_stage:
            self.groups.send_object({t: x.cpu() for t, x in self.taps.items()}, 0)
