"""Tandem workloads of the mid-shape benchmark: prefill of one prompt, and decode steps of a full batch.

Decode batches are filled without prefilling every request: one request is prefilled to the context
length, then its pages and KDA state are copied into B-1 reservations taken through the P/D consumer API
(``reserve_import`` -> copy -> ``insert_prefilled``), so all B requests hold the same real context. Each
copy continues from a different next token: B identical rows would route every row to the same top-k
experts (8 of 256 read per MoE layer at B = 64 instead of ~170), which made earlier decode numbers cheaper
than a real batch; with distinct tokens the rows route, and then continue, apart.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def lone_prompt_engine(layers: int, tiny: bool, lengths: list[int], kv_gib: float, **kw: Any) -> LLMEngine:
    """An engine on the mid checkpoint (written if absent) sized for one prompt of up to max(lengths) tokens:
    bf16 on CUDA, fp32 on the host; ``kw`` goes to EngineConfig (page_size, cuda_graphs, max_num_seqs, ...)."""
    from bench.mid.checkpoint import MidSpec, write_mid_model

    cuda = torch.cuda.is_available()
    model_dir = Path(f"/tmp/tandem-mid-kimi-{layers}l{'-tiny' if tiny else ''}")
    write_mid_model(model_dir, MidSpec("kimi_linear", layers, tiny))
    cfg: dict[str, Any] = {
        "model": str(model_dir),
        "device": "cuda" if cuda else "cpu",
        "dtype": "bfloat16" if cuda else "float32",
        "max_num_seqs": 4,
        "max_num_batched_tokens": max(lengths),
        "max_model_len": max(lengths) + 64,
        "kv_cache_memory_bytes": int(kv_gib * (1 << 30)) if cuda else (256 << 20),
    }
    return LLMEngine(EngineConfig(**{**cfg, **kw}))


def prompt(length: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (length,), generator=g).tolist()


def prefill_seconds(eng: LLMEngine, ids: list[int], repeat: int) -> tuple[float, list[float]]:
    """Median wall seconds of a one-token generate of `ids` (the first call warms up)."""
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    for i in range(repeat + 1):
        sync(eng.device)
        t0 = time.perf_counter()
        eng.generate([ids], one)
        sync(eng.device)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def fill_decode_batch(eng: LLMEngine, ctx: int, batch: int, seed: int = 7) -> list[str]:
    """`batch` running requests, each at `ctx` cached tokens plus one sampled token (module docstring)."""
    ids = prompt(ctx, eng.model_config.vocab_size, seed)
    params = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
    src_id = eng.add_request(ids, params)
    while True:
        eng.step()
        src = eng._requests[src_id]
        if src.output_token_ids:
            break
    rids = [src_id]
    n_pages = -(-ctx // eng.config.page_size)
    src_pages = torch.tensor(src.page_ids[:n_pages], device=eng.device)
    for j in range(batch - 1):
        res = eng.reserve_import(f"{src_id}-copy{j}", ctx)
        if res is None:
            raise RuntimeError(f"no room for {batch} x {ctx} tokens: raise --kv-gib or lower the batch")
        dst = torch.tensor(res.page_ids, device=eng.device)
        for kv in eng.cache.kv.values():
            kv[dst] = kv[src_pages]
        if res.slot_ids:
            eng.cache.copy_slot(src.slot_ids[0], res.slot_ids[0])
        first = (src.output_token_ids[0] + 7919 * (j + 1)) % eng.model_config.vocab_size  # a row of its own
        eng.insert_prefilled(res, ids, params, first, None)
        rids.append(res.request_id)
    return rids


@contextlib.contextmanager
def first_logits(eng: LLMEngine) -> Iterator[list[torch.Tensor]]:
    """Collects (on the host, fp32) the logits the sampler sees on the first step inside the block."""
    seen: list[torch.Tensor] = []
    sample = eng.sampler.sample

    def recording(logits: torch.Tensor, requests: list) -> list:
        if not seen:
            seen.append(logits.float().cpu().clone())
        return sample(logits, requests)

    eng.sampler.sample = recording
    try:
        yield seen
    finally:
        eng.sampler.sample = sample


def clear(eng: LLMEngine, rids: list[str]) -> None:
    for r in rids:
        eng.abort_request(r)


def drain(eng: LLMEngine) -> None:
    """Finish an overlapped step still in flight (its requests were aborted: it returns nothing)."""
    while getattr(eng, "overlap", None) is not None and eng.overlap.inflight is not None:
        eng.step()


@dataclass(frozen=True)
class StepTimes:
    mean: float
    """Seconds: wall from a synced, idle GPU to the end of the last step, over the steps (earlier sessions' number:
    it carries the first launch from the idle GPU, and with overlapped steps the drain of the one in flight)."""
    median: float
    """Seconds: the median gap between consecutive ``step()`` returns after the first, one step in steady state
    (with overlapped steps each return waits for one step's GPU work)."""
    tokens: list[list[int]]


def decode_steps_timed(eng: LLMEngine, steps: int, warmup: int = 2) -> StepTimes:
    """Decode-only steps (sampling included) after ``warmup`` untimed ones: both step times and each step's tokens."""
    for _ in range(warmup):
        eng.step()
    sync(eng.device)
    tokens = []
    marks = [time.perf_counter()]
    for _ in range(steps):
        outs = eng.step()
        marks.append(time.perf_counter())
        tokens.append([o.output_token_ids[-1] for o in outs])
    sync(eng.device)
    end = time.perf_counter()
    gaps = [b - a for a, b in itertools.pairwise(marks[1:])]  # from the first return on
    return StepTimes((end - marks[0]) / steps, statistics.median(gaps) if gaps else (end - marks[0]) / steps, tokens)


def decode_steps(eng: LLMEngine, steps: int, warmup: int = 2) -> tuple[float, list[list[int]]]:
    """Mean wall seconds of a decode-only step (sampling included), and the tokens each step produced."""
    t = decode_steps_timed(eng, steps, warmup)
    return t.mean, t.tokens


def experts_touched(eng: LLMEngine) -> list[int]:
    """Distinct routed experts each MoE layer routes to in one decode step (runs that step). The shared expert,
    when the backend folds it in as one more routed expert (``extra_expert``), is not counted: its weights are
    counted with the dense ones."""
    moe = eng.model.backends.moe
    seen: list[int] = []
    route = moe.route_hidden  # the models' one entry (the GPU backend's one-launch route calls no ``route``)

    def counting(*a: Any, **k: Any) -> Any:
        weights, ids = route(*a, **k)
        extra = k.get("extra_expert")
        routed = ids if extra is None else ids[ids != extra]
        seen.append(int(routed.unique().numel()))
        return weights, ids

    moe.route_hidden = counting
    fused = getattr(moe, "route_gate_up", None)  # its launch routes without ``route_hidden``: the same experts
    if fused is not None:
        moe.route_gate_up = False
    try:
        eng.step()
    finally:
        del moe.route_hidden  # back to the class method
        if fused is not None:
            moe.route_gate_up = fused
    return seen


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0
