"""Run-to-run spread of a lone prompt's prefill step, and how much of it is Python's garbage collector.

    python -m bench.prefill_spread --lengths 8192 --runs 15 --out /tmp/prefill_spread.json   # on the H200
    python -m bench.prefill_spread --tiny --lengths 256 --runs 3                             # on the host
    python -m bench.prefill_spread --tiny --lengths 8192 --host-prefix --runs 30              # any machine

The 8k step's wall time has varied by ~1.5 ms between processes on the same kernels (docs/PERFORMANCE.md,
nineteenth session); its host prefix (schedule, prepare, the first launches) is serial with the GPU. Each run
here is one synchronised one-token generate on the mid checkpoint of ``bench.gpu_mid``, with ``gc.callbacks``
timing every collection that falls inside it and ``time.perf_counter`` around the runner's ``prepare`` and
the whole ``execute`` enqueue. Variants, in one process, interleaved run by run: ``gc`` (the interpreter's
defaults) and ``frozen`` (``gc.freeze()`` after warm-up: the engine's long-lived objects leave the collector's
generations, as vLLM and SGLang do after start-up). Reported per variant: median / min / max wall, MFU of the
median against the matmul peak measured here, GC time and collections per run, prepare and enqueue medians.

``--host-prefix``: only the serial host work before a lone prompt's first kernel — ``add_request``
(validation), ``schedule`` and the runner's ``prepare`` — medians over ``--runs``, the model never run (each
request is aborted); device-independent, so it runs on the CPU host too.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.mid import costs, tandem_bench
from bench.mid.roofline import matmul_peak_flops
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


class GcClock:
    """Seconds and collections (by generation) spent in the collector while armed."""

    def __init__(self) -> None:
        self.seconds, self.by_gen, self._t0, self.armed = 0.0, [0, 0, 0], 0.0, False
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        if not self.armed:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.by_gen[info["generation"]] += 1

    def reset(self) -> None:
        self.seconds, self.by_gen = 0.0, [0, 0, 0]


def _timed_runner(eng: LLMEngine, marks: dict[str, float]) -> None:
    """Wrap the runner's prepare / execute to time them per run (host seconds)."""
    runner = eng.runner
    prepare, execute = runner.prepare, runner.execute

    def timed_prepare(chunks):
        t0 = time.perf_counter()
        out = prepare(chunks)
        marks["prepare"] += time.perf_counter() - t0
        return out

    def timed_execute(chunks):
        t0 = time.perf_counter()
        out = execute(chunks)
        marks["execute"] += time.perf_counter() - t0
        return out

    runner.prepare, runner.execute = timed_prepare, timed_execute


def measure(eng: LLMEngine, length: int, runs: int, peak: float) -> dict[str, Any]:
    ids = tandem_bench.prompt(length, eng.model_config.vocab_size, length)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    clock, marks = GcClock(), {"prepare": 0.0, "execute": 0.0}
    _timed_runner(eng, marks)
    for _ in range(2):  # warm-up: compiles, autotune, allocator growth
        eng.generate([ids], one)
    rows: dict[str, list[dict[str, float]]] = {"gc": [], "frozen": []}
    for i in range(2 * runs):
        variant = "gc" if i % 2 == 0 else "frozen"
        if variant == "frozen":
            gc.collect()
            gc.freeze()
        tandem_bench.sync(eng.device)
        clock.reset()
        marks["prepare"] = marks["execute"] = 0.0
        clock.armed = True
        t0 = time.perf_counter()
        eng.generate([ids], one)
        tandem_bench.sync(eng.device)
        wall = time.perf_counter() - t0
        clock.armed = False
        if variant == "frozen":
            gc.unfreeze()
        rows[variant].append(
            {"wall": wall, "gc": clock.seconds, "collections": sum(clock.by_gen), "gen2": clock.by_gen[2], **marks}
        )
    flops = costs.prefill_flops(eng.model_config, length)["total"]
    out: dict[str, Any] = {"length": length, "runs": runs}
    for variant, rs in rows.items():
        walls = [r["wall"] for r in rs]
        med = statistics.median(walls)
        out[variant] = {
            "wall_ms": {"median": med * 1e3, "min": min(walls) * 1e3, "max": max(walls) * 1e3},
            "walls_ms": [w * 1e3 for w in walls],
            "mfu_median": flops / med / peak,
            "mfu_best": flops / min(walls) / peak,
            "gc_ms_per_run": statistics.mean(r["gc"] for r in rs) * 1e3,
            "collections_per_run": statistics.mean(r["collections"] for r in rs),
            "gen2_runs": sum(1 for r in rs if r["gen2"]),
            "prepare_ms": statistics.median(r["prepare"] for r in rs) * 1e3,
            "execute_ms": statistics.median(r["execute"] for r in rs) * 1e3,
        }
    return out


def host_prefix(eng: LLMEngine, length: int, runs: int) -> dict[str, float]:
    ids = tandem_bench.prompt(length, eng.model_config.vocab_size, length)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    parts: dict[str, list[float]] = {"add_request": [], "schedule": [], "prepare": []}
    for i in range(runs + 5):  # 5 warm-up rounds
        t0 = time.perf_counter()
        rid = eng.add_request(ids, one)
        t1 = time.perf_counter()
        sched = eng.scheduler.schedule()
        t2 = time.perf_counter()
        eng.runner.prepare(sched.chunks)
        t3 = time.perf_counter()
        eng.abort_request(rid)
        eng.step()  # lets the scheduler release the aborted request's pages
        if i >= 5:
            for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                parts[k].append(v)
    return {f"{k}_ms": statistics.median(v) * 1e3 for k, v in parts.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefill_spread", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--lengths", type=int, nargs="+", default=[8192])
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--host-prefix", action="store_true", help="only add_request / schedule / prepare medians")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    paging = {"page_size": a.page_size} if a.page_size else {}
    eng = tandem_bench.lone_prompt_engine(a.layers, a.tiny, a.lengths, kv_gib=8.0, **paging)
    if a.host_prefix:
        for length in a.lengths:
            r = host_prefix(eng, length, a.runs)
            print(f"prompt {length}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
        return 0
    device = eng.device
    peak = matmul_peak_flops(device)["flops_per_s"] if cuda else 1e12
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "peak_flops": peak, "lengths": []}
    for length in a.lengths:
        r = measure(eng, length, a.runs, peak)
        res["lengths"].append(r)
        for v in ("gc", "frozen"):
            x = r[v]
            w = x["wall_ms"]
            print(
                f"prefill {length} [{v:>6}]: median {w['median']:.2f} ms (min {w['min']:.2f}, max {w['max']:.2f}),"
                f" MFU {x['mfu_median']:.1%} (best {x['mfu_best']:.1%}); GC {x['gc_ms_per_run']:.2f} ms a run"
                f" ({x['collections_per_run']:.1f} collections, gen2 in {x['gen2_runs']} runs); prepare"
                f" {x['prepare_ms']:.2f} ms, execute enqueue {x['execute_ms']:.2f} ms",
                flush=True,
            )
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
