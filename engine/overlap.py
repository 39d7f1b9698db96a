"""Overlapped decode (EngineConfig.async_scheduling): step N+1 is launched before the host reads step N's ids.

A decode step's host work (schedule, fill the static buffers, post-process, build outputs) is as long as
its GPU work at batch 64 with CUDA graphs; in sequence the GPU idles while the host works. Here, once a
pure-decode step N is on the stream, step N+1 is put behind it at once, its input ids gathered on the
device from N's greedy ids, which N's graph writes itself (StaticDecodeBuffers.fill / prepare, `carried`).
Only then does the host wait for N's ids and post-process them, while N+1 runs. Each `LLMEngine.step()`
still returns one step's outputs.

Step N+1 continues step N only when nothing else could change the batch: no request waits for a prefill,
a request that joined the running set between the steps is ready to decode (a P/D import: its first token is
on the host, so its row takes the host id), no rung checkpoint is pending or due, every row is greedy
without logprobs (the ids are argmaxes on the device, as the sampler takes them), and pages for the next
token can be reserved. Otherwise N is drained and the next step is scheduled as usual.

A request that stops by length at N is left out of N+1. One that stops on EOS at N (unknown when N+1 is
launched) computes one more row in N+1, dropped by post-processing; its pages and slot are freed after N+1
was enqueued, and every later user of them is enqueued after N+1 on the same stream. So the tokens are the
sequential engine's: the same argmax of the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.decode_graph import DecodeGraphs
from engine.request import Request
from engine.scheduler import SampleResult, ScheduledChunk, Scheduler


@dataclass
class InflightStep:
    """A launched decode step whose sampled ids are still on the device."""

    chunks: list[ScheduledChunk]
    host: torch.Tensor
    """[n] int64 host copy of the step's greedy ids (pinned on CUDA), valid once `done` has fired."""
    done: torch.cuda.Event | None

    def wait(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


class OverlapDecoder:
    def __init__(self, graphs: DecodeGraphs, scheduler: Scheduler, device: torch.device) -> None:
        self.graphs, self.scheduler, self.device = graphs, scheduler, device
        pin = device.type == "cuda"
        n = graphs.batch_sizes[-1]
        # two host buffers alternate: step N+1's copy must not land in N's before the host has read it
        self._host = [torch.zeros(n, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._next = 0
        self.inflight: InflightStep | None = None
        self.counts = {"launched": 0, "continued": 0, "drained": 0, "rows": 0, "joined": 0}

    def accepts(self, chunks: list[ScheduledChunk]) -> bool:
        """A scheduled step that can start an overlapped run."""
        if not self.graphs.accepts(chunks):
            return False
        return all(c.request.fork_slot is None and _greedy_only(c.request) for c in chunks)

    def start(self, chunks: list[ScheduledChunk]) -> None:
        self.inflight = self._launch(chunks, None)

    def advance(self) -> tuple[list[ScheduledChunk], dict[str, SampleResult]]:
        """Launch the continuation of the in-flight step when it has one, then wait for the in-flight step's
        ids: its chunks and results, for the scheduler's post-processing."""
        prev = self.inflight
        assert prev is not None, "advance() without a step in flight"
        nxt = self._continuation(prev)
        self.inflight = self._launch(nxt, prev) if nxt else None
        if nxt:
            self.counts["continued"] += 1
        else:
            self.counts["drained"] += 1
        tokens = prev.wait()
        results = {c.request.request_id: SampleResult([t], []) for c, t in zip(prev.chunks, tokens, strict=True)}
        return prev.chunks, results

    # ---- internals ---------------------------------------------------------------------------
    def _launch(self, chunks: list[ScheduledChunk], prev: InflightStep | None) -> InflightStep:
        carried = None
        if prev is not None:
            row = {id(c.request): i for i, c in enumerate(prev.chunks)}
            carried = [row.get(id(c.request), -1) for c in chunks]  # -1: joined, its id is on the host
        self.graphs.run(chunks, carried)  # its greedy ids come out of the step itself (inside its graph)
        host = self._host[self._next][: len(chunks)]
        self._next ^= 1
        host.copy_(self.graphs.sampled(len(chunks)), non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        self.counts["launched"] += 1
        self.counts["rows"] += len(chunks)
        return InflightStep(chunks, host, done)

    def _continuation(self, prev: InflightStep) -> list[ScheduledChunk] | None:
        """Step N+1's chunks: one token per request of N that keeps decoding, then one per request that joined
        ready to decode (a P/D import: its first token is on the host). None when the batch must be
        scheduled as usual."""
        s = self.scheduler
        if s.waiting or not self.graphs.enabled:
            return None
        in_prev = {id(c.request) for c in prev.chunks}
        joined = [r for r in s.running if id(r) not in in_prev]
        chunks: list[ScheduledChunk] = []
        for c in prev.chunks:
            req = c.request
            if req.is_finished:  # aborted between steps
                continue
            if c.checkpoints:
                return None
            p = c.start + 1  # the position of N's sampled token
            if len(req.output_token_ids) + 1 >= req.params.max_tokens or req.num_tokens + 1 >= s.max_model_len:
                continue  # N's token ends it by length: nothing to compute
            if not self._can_decode(req, p):
                return None
            chunks.append(ScheduledChunk(req, p, 1))
        for req in joined:
            p = req.num_computed_tokens
            if p != req.num_tokens - 1 or req.draft_tokens or req.fork_slot is not None or not self._can_decode(req, p):
                return None
            chunks.append(ScheduledChunk(req, p, 1))
        if len(chunks) > self.graphs.batch_sizes[-1]:
            return None
        self.counts["joined"] += len(joined)
        return chunks or None

    def _can_decode(self, req: Request, p: int) -> bool:
        """Whether position p of req can run in an overlapped step (reserving its page)."""
        s = self.scheduler
        if req.pending_checkpoints or not _greedy_only(req):
            return False
        if p + 1 > self.graphs.max_context:
            return False
        if s.prefix is not None and s.slots is not None and s.prefix.rungs_in(p, p + 1):
            return False  # a rung is due: the scheduler places its checkpoint
        return s._reserve_pages(req, p + 1)  # False: the scheduler decides whom to preempt


def _greedy_only(req: Request) -> bool:
    """Its token is the logits' argmax and nothing else is reported: the device can pick it alone."""
    return req.params.greedy and req.params.logprobs is None
