"""Shared by the multi-rank tests: engines, reference runs, and functions run on every rank.

Functions passed to ``ParallelLLMEngine.collective_call`` are pickled by reference, so they live at
module level here (every rank imports this module from the worktree it was started in).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, RequestOutput
from engine.parallel import create_engine
from engine.parallel.config import ParallelConfig
from engine.parallel.launcher import RankState
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
BASE = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)


def engine(model: Path, parallel: ParallelConfig | None = None, **kw: Any) -> LLMEngine:
    return create_engine(EngineConfig(model=str(model), parallel=parallel or ParallelConfig(), **{**BASE, **kw}))


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.output_token_ids for o in outs]


@functools.cache
def reference(model: Path, prompts: tuple[tuple[int, ...], ...], params: SamplingParams, **kw: Any) -> list[list[int]]:
    """Greedy tokens of the single-rank engine (cached: several layouts compare against one run)."""
    return tokens(engine(model, **kw).generate([list(p) for p in prompts], params))


# ---- run on every rank --------------------------------------------------------------------------------------
def emitted(state: RankState) -> list[int]:
    return list(state.runner.emitted)


def accepted(state: RankState) -> list[int]:
    return list(state.runner.accepted)


def caches_of(cache: Any, pages: list[int], slot: int, num_tokens: int) -> dict[str, dict[int, torch.Tensor]]:
    """One request's KV rows (token order) and KDA state, from a cache."""
    return {
        "kv": {i: t[pages].flatten(0, 1)[:num_tokens].clone() for i, t in cache.kv.items()},
        "recurrent": {i: t[slot].clone() for i, t in cache.recurrent.items()},
        "conv": {i: t[slot].clone() for i, t in cache.conv.items()},
    }


def _request_caches(state: RankState, pages: list[int], slot: int, num_tokens: int) -> dict:
    return caches_of(state.cache, pages, slot, num_tokens)


def request_caches(pages: list[int], slot: int, num_tokens: int) -> Any:
    return functools.partial(_request_caches, pages=pages, slot=slot, num_tokens=num_tokens)


_SEEN: list[tuple[int, int]] = []
"""(this rank's own argmax, the id rank 0 will emit) per sampled row, recorded by the tie hook."""


def install_tie_hook(state: RankState, nudge_rank: int) -> None:
    """Make every rank's top two logits of each row tie exactly; on nudge_rank, raise the one argmax does
    not pick by one ULP. Ranks then differ by one ULP in one logit and their own argmaxes disagree."""

    def hook(logits: torch.Tensor) -> torch.Tensor:
        out = logits.clone()
        top = out.topk(2, dim=-1).indices
        lo, hi = top.min(dim=-1).values, top.max(dim=-1).values
        rows = torch.arange(out.shape[0])
        out[rows, hi] = out[rows, lo]  # exact tie: argmax takes the first, lo
        if state.rank == nudge_rank:
            out[rows, hi] = torch.nextafter(out[rows, lo], torch.tensor(float("inf")))
        _SEEN.extend(zip(out.argmax(dim=-1).tolist(), lo.tolist(), strict=True))
        return out

    _SEEN.clear()
    state.runner.logits_hooks[:] = [hook]


def seen(state: RankState) -> list[tuple[int, int]]:
    return list(_SEEN)


def clear_logits_hooks(state: RankState) -> None:
    state.runner.logits_hooks.clear()


_WRITES: list[tuple[float, tuple[int, ...]]] = []
_RECORDERS: list[Any] = []


def install_checkpoint_recorder(state: RankState, delay_s: float) -> None:
    """Record when this stage has run its layers over a batch that writes KDA checkpoints; the last
    stage also dawdles, so a filing that does not wait for it would come first."""
    last = state.stage.layers[-1]

    def hook(layer: int, batch: Any) -> None:
        slots = tuple(dst for cks in batch.checkpoints for _, dst in cks)
        if layer == last and slots:
            if state.groups.is_last_stage:
                time.sleep(delay_s)
            _WRITES.append((time.monotonic(), slots))

    _WRITES.clear()
    _RECORDERS.append(hook)
    state.stage.model.layer_hooks.append(hook)


def checkpoint_writes(state: RankState) -> list[tuple[float, tuple[int, ...]]]:
    return list(_WRITES)


def clear_layer_hooks(state: RankState) -> None:
    """Remove the hooks these helpers installed (not the engine's own)."""
    hooks = state.stage.model.layer_hooks
    hooks[:] = [h for h in hooks if h not in _RECORDERS]
    _RECORDERS.clear()


def check_sampled_ids_agree(eng: Any, nudge_rank: int) -> None:
    """Ranks whose logits differ by one ULP (and whose own argmaxes therefore disagree on every row)
    still emit exactly the ids rank 0 sampled, on every rank."""
    eng.collective_call(functools.partial(install_tie_hook, nudge_rank=nudge_rank))
    try:
        eng.generate([[7, 8, 9], [100, 101, 102, 103, 104]], GREEDY)
        seen_by_rank = eng.collective_call(seen)
        emitted_by_rank = eng.collective_call(emitted)
    finally:
        eng.collective_call(clear_logits_hooks)
    assert all(e == emitted_by_rank[0] for e in emitted_by_rank), "ranks emitted different ids"
    p = eng.parallel
    leader = p.rank_of(p.pp - 1, 0)  # its logits are the ones rank 0 samples
    n = len(seen_by_rank[leader])
    assert n == 2 * GREEDY.max_tokens
    assert emitted_by_rank[0][-n:] == [own for own, _ in seen_by_rank[leader]]
    for rank, rows in enumerate(seen_by_rank):
        if rows:  # a rank that computed logits: its own pick flips exactly when it was nudged
            assert all((own != lo) == (rank == nudge_rank) for own, lo in rows), rank
    assert seen_by_rank[nudge_rank], "the nudged rank computed no logits"
