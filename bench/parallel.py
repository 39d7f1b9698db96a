"""Parallel prefill / decode benchmark: ``python -m bench.parallel [--model DIR] [--device cuda]``.

Measures, each layout against its single-rank baseline on the same model:

    pcp=2 vs pcp=1   prefill of long prompts (time to first token, tokens/s)
    pp=2  vs pp=1    prefill throughput of a batch of prompts (microbatched stages)
    tp=2  vs tp=1    decode step time of a running batch (LM head replicated and vocab-sharded)

On CUDA (NCCL) when available, else CPU (gloo) on the tiny model; prints a table. Every rank is a
process started by the engine, as in serving. ``--breakdown`` adds where a PCP step's time goes
(gathers, the redundant KDA recurrence) on rank 0.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.call_timer import timed_calls
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.parallel import create_engine
from engine.parallel.config import ParallelConfig
from engine.parallel.launcher import cpu_seconds
from engine.sampling_params import SamplingParams


@dataclass
class Row:
    what: str
    layout: str
    value: float
    unit: str
    cpu_ms: float | None = None
    """The busiest rank's CPU time for the same work (ms)."""
    baseline: Row | None = None

    def _ratio(self, mine: float, base: float) -> float:
        return base / mine if self.unit == "ms" else mine / base

    def speedup(self) -> str:
        return "" if self.baseline is None else f"{self._ratio(self.value, self.baseline.value):.2f}x"

    def cpu_speedup(self) -> str:
        b = self.baseline
        if b is None or self.cpu_ms is None or b.cpu_ms is None:
            return ""
        return f"{b.cpu_ms / self.cpu_ms:.2f}x"


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _engine(args: argparse.Namespace, parallel: ParallelConfig, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(
        model=str(args.model),
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=max(args.batch, 8),
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        parallel=parallel,
        **kw,
    )
    return create_engine(cfg)


def _timed(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prefill_seconds(eng: LLMEngine, prompts: list[list[int]], repeat: int) -> float:
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    return _timed(lambda: eng.generate(prompts, one), repeat)


def decode_step_ms(eng: LLMEngine, prompts: list[list[int]], steps: int) -> float:
    """Mean step time of decode-only steps, the batch already prefilled."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, params)
    while any(not r.output_token_ids for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    eng.step()  # warm-up decode step
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    took = (time.perf_counter() - t0) / steps
    while eng.has_unfinished_requests():
        eng.step()
    return took * 1e3


def pcp_breakdown(eng: Any, prompts: list[list[int]]) -> dict[str, float]:
    """Seconds rank 0 spends in PCP collectives (all of them, the KDA layout exchanges included) and in KDA
    (the conv over its own segments, the recurrence over them plus the scan and its gather), one prefill."""
    keys = ("collectives", "KDA short conv (own segments)", "KDA recurrence (own segments + scan)")
    targets = [(eng.groups, name, keys[0]) for name in ("all_gather", "all_reduce", "all_to_all")]
    kda = eng.model.backends.kda
    if hasattr(kda, "inner"):
        targets += [(kda.inner, "short_conv", keys[1]), (kda, "_scan", keys[2])]
    with timed_calls(targets) as times:
        t0 = time.perf_counter()
        eng.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        total = time.perf_counter() - t0
    spent = {key: times.spent.get(key, 0.0) for key in keys}
    spent["step total"] = total
    return spent


def rank_cpu(eng: Any) -> list[float]:
    """CPU seconds each rank has used so far (this process for a single-rank engine)."""
    return eng.collective_call(cpu_seconds) if hasattr(eng, "collective_call") else [cpu_seconds()]


def measured(eng: Any, fn: Callable[[], float]) -> tuple[float, float]:
    """fn's result, and the largest per-rank CPU time it took: the critical path when every rank has
    its own core (wall time cannot show that on a host with fewer cores than ranks)."""
    before = rank_cpu(eng)
    value = fn()
    after = rank_cpu(eng)
    return value, max(b - a for a, b in zip(before, after, strict=True))


def run(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    vocab = 512
    long_prompts = _prompts(1, args.long_prompt_len, vocab, 1)
    batch_prompts = _prompts(args.batch, args.prompt_len, vocab, 2)
    budget = dict(max_num_batched_tokens=max(args.long_prompt_len, args.batch * args.prompt_len))
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    base = None
    for pcp in (1, 2):
        eng = _engine(args, ParallelConfig(pcp=pcp), **budget)
        t = prefill_seconds(eng, long_prompts, args.repeat)
        _, cpu = measured(eng, lambda eng=eng: eng.generate(long_prompts, one) and 0.0)
        rows.append(Row(f"prefill {args.long_prompt_len} tokens", f"pcp={pcp}", t * 1e3, "ms", cpu * 1e3, base))
        base = base or rows[-1]
        if args.breakdown and pcp == 2:
            for k, v in pcp_breakdown(eng, long_prompts).items():
                rows.append(Row(f"  rank 0: {k}", "pcp=2", v * 1e3, "ms"))
        eng.close()

    base = None
    n_tokens = len(batch_prompts) * args.prompt_len
    for pp in (1, 2):
        eng = _engine(args, ParallelConfig(pp=pp), **budget)
        t = prefill_seconds(eng, batch_prompts, args.repeat)
        _, cpu = measured(eng, lambda eng=eng: eng.generate(batch_prompts, one) and 0.0)
        what = f"prefill {args.batch} x {args.prompt_len} tokens"
        rows.append(Row(what, f"pp={pp}", n_tokens / t, "tok/s", cpu * 1e3, base))
        base = base or rows[-1]
        eng.close()

    base = None
    decode_prompts = _prompts(args.batch, args.prompt_len, vocab, 3)
    for tp, shard in ((1, None), (2, False), (2, True)):
        eng = _engine(args, ParallelConfig(tp=tp, tp_shard_lm_head=shard))
        ms, cpu = measured(eng, lambda eng=eng: decode_step_ms(eng, decode_prompts, args.decode_steps))
        head = "" if tp == 1 else (" (LM head vocab-sharded)" if shard else " (LM head replicated)")
        cpu_per_step = cpu * 1e3 / (args.decode_steps + 3)  # + prefill steps, roughly: a ratio, not a time
        rows.append(Row(f"decode step, batch {args.batch}", f"tp={tp}{head}", ms, "ms", cpu_per_step, base))
        base = base or rows[-1]
        eng.close()
    return rows


def print_table(rows: list[Row], device: str) -> None:
    print(f"\nTandem parallel benchmark ({device})")
    w = max(len(r.what) for r in rows)
    lw = max(len(r.layout) for r in rows)
    head = f"{'measurement':<{w}}  {'layout':<{lw}}  {'wall':>15}  {'vs 1 rank':>9}  "
    print(head + f"{'busiest rank CPU':>16}  {'vs 1 rank':>9}")
    for r in rows:
        cpu = f"{r.cpu_ms:.1f} ms" if r.cpu_ms is not None else ""
        print(
            f"{r.what:<{w}}  {r.layout:<{lw}}  {r.value:>11.2f} {r.unit:<5}  {r.speedup():>9}  {cpu:>16}  "
            f"{r.cpu_speedup():>9}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.parallel", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="HF checkpoint dir (default: the bundled tiny model)")
    p.add_argument("--device", default="auto", help="cuda (NCCL) when available, else cpu (gloo)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--long-prompt-len", type=int, default=None, help="pcp prompt (default: 8192 cuda, 2048 cpu)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--breakdown", action="store_true", help="where a pcp=2 prefill spends its time (rank 0)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and args.device in ("auto", "cuda")
    args.device = "cuda" if cuda else "cpu"
    if args.model is None:
        from tandem.cli import default_model

        args.model = default_model()
    if args.long_prompt_len is None:
        args.long_prompt_len = 8192 if cuda else 2048
    if not cuda:
        torch.set_num_threads(1)
        args.kv_cache_memory_bytes = args.kv_cache_memory_bytes or 64 << 20
    rows = run(args)
    print_table(rows, "CUDA, NCCL" if cuda else "CPU, gloo, one thread per rank")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
