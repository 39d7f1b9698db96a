"""Where a prefill step's host (Python) time goes, and how much of it the GPU waits on.

    python -m bench.prefill_host --lengths 8192 32768 --out /tmp/prefill_host.json   # on the H200
    python -m bench.prefill_host --tiny --lengths 256                                 # on the host: plumbing

A prefill launches ~700 kernels; when launching them takes longer than running them the step is host-bound
and its wall time is the host's. Three numbers per prompt length, on the mid checkpoint of ``bench.gpu_mid``:

- wall: a one-token generate, synchronised (what ``gpu_mid`` reports);
- host: the same step with the GPU held busy first (``torch.cuda._sleep``) so no launch waits on the device,
  with no profiler: the time from the step's start until the model runner returns (before and inside
  ``runner.execute``; the forward has no sync, so this is the time the host needs to enqueue it), and, with
  the CPU-only profiler, until the first blocking call;
- kernel: the step's GPU kernel time (profiler).

Then a cProfile of one held step: the Python functions that spend the host time (tottime and cumulative).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.call_timer import timed_calls
from bench.mid import gaps as mid_gaps
from bench.mid import profile, tandem_bench
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

HOLD_S = 0.5  # GPU busy time ahead of a held step: longer than any host enqueue measured here


def _hold_gpu(seconds: float) -> None:
    """Queue a kernel that spins ~`seconds` so the step's launches never wait on the device."""
    if torch.cuda.is_available():
        hz = torch.cuda.get_device_properties(0).clock_rate * 1e3  # kHz -> Hz (SM clock)
        torch.cuda._sleep(int(seconds * hz))


def _blocking_seconds(stats: pstats.Stats) -> float:
    """Time inside the calls that wait for the device (the held step's first sync absorbs the hold)."""
    waits = ("item", "tolist", "cpu", "synchronize", "_local_scalar_dense")
    total = 0.0
    for (_, _, name), (_, _, tt, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        if any(name == w or f"'{w}'" in name for w in waits):  # a function, or "<method 'tolist' of ...>"
            total += tt
    return total


def _held_host_seconds(eng: LLMEngine, ids: list[int], one: SamplingParams) -> tuple[float, str]:
    """Host enqueue time of a held step without cProfile's overhead: CPU ops only, from the first op to the
    start of the op that waits longest (the first blocking call, which absorbs the hold and the kernels)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    tandem_bench.sync(eng.device)
    _hold_gpu(HOLD_S)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.generate([ids], one)
    events = [e for e in prof.events() if e.time_range.end > e.time_range.start]
    first = min(e.time_range.start for e in events)
    wait = max(events, key=lambda e: e.self_cpu_time_total)
    return (wait.time_range.start - first) / 1e6, wait.name


# Backend calls a piecewise CUDA graph leaves outside its pieces (their launch grids follow the step's sequence
# layout), and the MoE, which a piece holds: their host time in a held step.
_GROUPS = {
    "kda_core": ("kda", ("gated_conv_recurrence", "conv_recurrence")),  # nested calls count once
    "attention_core": ("attention", ("write_kv", "mla", "gqa")),
    "moe": ("moe", ("route", "experts")),
}


# Inside the groups above (not subtracted again): the step's prepare, and the KDA core's parts.
_PARTS = {
    "prepare": ("runner", ("prepare",)),
    "kda_conv": ("kda", ("short_conv_qkv",)),
    "kda_recurrence": ("kda", ("recurrence",)),
    "kda_chunk_fn": ("kda", ("chunk_fn",)),
}


def _held_step_seconds(eng: LLMEngine, ids: list[int], one: SamplingParams) -> dict[str, float]:
    """Host seconds of a held step, uninstrumented but for the wrapped calls: before the model runner
    (``before_runner``), in it (``runner``), inside each group of backend calls (_GROUPS) and the rest of the
    runner (``other``: GEMMs, norms, glue); and the parts in _PARTS (the step's prepare, the KDA core's conv,
    recurrence and fla call), which sit inside those."""
    be = eng.model.backends
    owners = {"runner": eng.runner}
    targets = [(getattr(be, attr), name, group) for group, (attr, names) in _GROUPS.items() for name in names]
    targets += [
        (owners.get(attr) or getattr(be, attr), name, part)
        for part, (attr, names) in _PARTS.items()
        for name in names
        if hasattr(owners.get(attr) or getattr(be, attr), name)
    ]
    tandem_bench.sync(eng.device)
    _hold_gpu(HOLD_S)
    with timed_calls([*targets, (eng.runner, "execute", "runner")]) as times:
        t0 = time.perf_counter()
        eng.generate([ids], one)
    out = dict(times.spent)
    out["before_runner"] = times.first_start["runner"] - t0
    out["other"] = out["runner"] - sum(out[g] for g in _GROUPS)  # _PARTS sit inside the groups and the runner
    return out


def measure(
    eng: LLMEngine, length: int, repeat: int, top: int, trace_dir: Path | None = None, kernels: int = 0
) -> dict[str, Any]:
    ids = tandem_bench.prompt(length, eng.model_config.vocab_size, length)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    wall, _ = tandem_bench.prefill_seconds(eng, ids, repeat)
    held = []
    for _ in range(repeat):
        tandem_bench.sync(eng.device)
        _hold_gpu(HOLD_S)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        eng.generate([ids], one)
        prof.disable()
        total = time.perf_counter() - t0
        stats = pstats.Stats(prof)
        held.append((total - _blocking_seconds(stats), stats))
    host_s = statistics.median(h for h, _ in held)
    plain = [_held_host_seconds(eng, ids, one) for _ in range(repeat)]
    bare = [_held_step_seconds(eng, ids, one) for _ in range(repeat)]
    split = {k: statistics.median(b[k] for b in bare) for k in bare[0]}
    stats = held[len(held) // 2][1]
    out = io.StringIO()
    stats.stream = out  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    with profile.labelled_ops(eng.model):
        kprof = profile.profiled(lambda: eng.generate([ids], one), eng.device)
    census = profile.kernel_census(kprof)
    table = profile.top_kernels(kprof, eng.device, rows=kernels) if kernels else None
    gaps = None
    if trace_dir is not None:  # where the GPU waited in the profiled step (bench/mid/gaps.py)
        trace_dir.mkdir(parents=True, exist_ok=True)
        path = trace_dir / f"prefill-{length}-trace.json.gz"
        kprof.export_chrome_trace(str(path))
        gaps = mid_gaps.report(path.name, mid_gaps.summarise(mid_gaps.load_events(path), min_gap_us=50.0, top=12))
    return {
        "gaps": gaps,
        "top_kernels": table,
        "length": length,
        "wall_s": wall,
        "host_before_runner_s": split.pop("before_runner"),
        "host_runner_s": split["runner"],
        "host_split_s": split,
        "host_enqueue_s": statistics.median(h for h, _ in plain),
        "host_wait_op": plain[0][1],
        "host_enqueue_s_cprofile": host_s,
        "kernel_s": census["kernel_us_per_step"] / 1e6,
        "kernels_per_step": census["kernels_per_step"],
        "host_us_per_kernel_cprofile": host_s / max(census["kernels_per_step"], 1) * 1e6,
        "pstats": out.getvalue(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefill_host", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--lengths", type=int, nargs="+", default=[8192])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--top", type=int, default=45)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--cuda-graphs", action="store_true", help="the engine's CUDA graphs (piecewise prefill) on")
    p.add_argument("--trace-dir", type=Path, default=None, help="keep the profiled step's trace, list its GPU gaps")
    p.add_argument("--kernels", type=int, default=0, help="list the profiled step's N costliest ops / kernels")
    a = p.parse_args(argv)
    eng = tandem_bench.lone_prompt_engine(a.layers, a.tiny, a.lengths, kv_gib=16.0, cuda_graphs=a.cuda_graphs)
    warm = min(512, *a.lengths)
    eng.prompt_logits(tandem_bench.prompt(warm, eng.model_config.vocab_size, 0))  # compile + fla autotune
    rows = []
    for length in a.lengths:
        r = measure(eng, length, a.repeat, a.top, a.trace_dir, a.kernels)
        rows.append(r)
        print(
            f"prefill {length}: wall {r['wall_s'] * 1e3:.1f} ms, host (no profiler) "
            f"{r['host_before_runner_s'] * 1e3:.1f} ms before the runner + {r['host_runner_s'] * 1e3:.1f} ms in it; "
            f"host enqueue (CPU profiler) "
            f"{r['host_enqueue_s'] * 1e3:.1f} ms "
            f"(waits in {r['host_wait_op']}; under cProfile "
            f"{r['host_enqueue_s_cprofile'] * 1e3:.1f} ms), kernels {r['kernel_s'] * 1e3:.1f} ms in "
            f"{r['kernels_per_step']:.0f} launches",
            flush=True,
        )
        print(
            "  host in the runner by backend group (held step, ms): "
            + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["host_split_s"].items()),
            flush=True,
        )
        if r["gaps"]:
            print(r["gaps"], flush=True)
        if r["top_kernels"]:
            print(r["top_kernels"], flush=True)
        print(r["pstats"])
    if a.out:
        device = torch.cuda.get_device_name() if eng.device.type == "cuda" else "cpu"
        a.out.write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
