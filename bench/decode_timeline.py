"""Where an overlapped decode step's wall time goes on the GPU: graph kernels, the gaps between them, and the
device work outside the captured graph (input fill, the carried ids' gather, argmax, the ids' copy home).

    python -m bench.decode_timeline --ctx 4096 --batches 1 16 64 --steps 10 [--trace-dir DIR] [--out F.json]

The overlapped step (``EngineConfig.async_scheduling``) should cost the GPU its graph replay and nothing else;
``bench.gpu_mid`` measures it ~0.1 ms above the back-to-back replay at every batch. Here a few overlapped steps
run under torch.profiler, and each device op is sorted by what launched it: a ``cudaGraphLaunch`` (the captured
step) or anything else, by the trace's correlation ids. Per step: the graph's kernel time and its internal
gaps, the outside ops by name, and the idle time around them (the host late, or a dependency).
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.mid import costs, roofline, tandem_bench
from bench.mid.gaps import merged
from engine.llm_engine import LLMEngine

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def classify(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Device ops split into graph-launched and outside ones; busy and idle time between the first and the last
    device op, in microseconds."""
    graph_corr = {
        e["args"].get("correlation")
        for e in events
        if e.get("cat") == "cuda_runtime" and e.get("name", "").startswith("cudaGraphLaunch")
    }
    dev = sorted((e for e in events if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
    if not dev:
        return {"device_ops": 0}
    inside = [e for e in dev if e["args"].get("correlation") in graph_corr]
    outside = [e for e in dev if e["args"].get("correlation") not in graph_corr]
    span = dev[-1]["ts"] + dev[-1]["dur"] - dev[0]["ts"]
    busy = sum(b - a for a, b in merged([(e["ts"], e["ts"] + e["dur"]) for e in dev]))
    # gaps inside a replay: between consecutive device ops that belong to the same graph launch
    gap_in, gap_out = 0.0, 0.0
    for prev, cur in itertools.pairwise(dev):
        gap = cur["ts"] - (prev["ts"] + prev["dur"])
        if gap <= 0:
            continue
        same = prev["args"].get("correlation") == cur["args"].get("correlation") and prev in inside
        if same:
            gap_in += gap
        else:
            gap_out += gap
    names: Counter[str] = Counter()
    us: Counter[str] = Counter()
    for e in outside:
        names[e["name"][:80]] += 1
        us[e["name"][:80]] += e["dur"]
    return {
        "device_ops": len(dev),
        "graph_launches": len(graph_corr),
        "span_us": span,
        "busy_us": busy,
        "graph_kernel_us": sum(e["dur"] for e in inside),
        "graph_internal_gap_us": gap_in,
        "outside_us": sum(e["dur"] for e in outside),
        "other_gap_us": gap_out,
        "outside_ops": [(n, names[n], us[n]) for n, _ in us.most_common(20)],
    }


def per_step(c: dict[str, Any], steps: int) -> dict[str, Any]:
    keys = ("span_us", "busy_us", "graph_kernel_us", "graph_internal_gap_us", "outside_us", "other_gap_us")
    out: dict[str, Any] = {k: c[k] / steps for k in keys}
    out["outside_ops"] = [(n, k / steps, t / steps) for n, k, t in c["outside_ops"]]
    out["graph_launches"] = c["graph_launches"]
    return out


def report(ctx: int, b: int, s: dict[str, Any]) -> str:
    lines = [
        f"ctx {ctx} batch {b}: {s['span_us']:.1f} us a step = graph kernels {s['graph_kernel_us']:.1f} + gaps inside "
        f"the graph {s['graph_internal_gap_us']:.1f} + ops outside it {s['outside_us']:.1f} + other gaps "
        f"{s['other_gap_us']:.1f}; unprofiled step {s.get('wall_us', 0):.1f} us (median; mean "
        f"{s.get('mean_wall_us', 0):.1f}) = {100 * s.get('roofline', 0):.1f} % of roofline"
    ]
    for name, n, t in s["outside_ops"]:
        lines.append(f"    outside: {n:4.1f} x {t:7.2f} us  {name}")
    return "\n".join(lines)


def _experts_touched_eagerly(eng: LLMEngine) -> list[int]:
    """tandem_bench.experts_touched on an eager step: its counting reads ids on the host, which a graph capture
    (the first step of a new batch size, decode or piecewise prefill) must not see."""
    graphs = [g for g in (eng.runner.decode_graphs, eng.runner.prefill_graphs) if g is not None]
    overlap, eng.overlap = eng.overlap, None
    for g in graphs:
        g.enabled = False
    try:
        return tandem_bench.experts_touched(eng)
    finally:
        for g in graphs:
            g.enabled = True
        eng.overlap = overlap


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode_timeline", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ctx", type=int, nargs="+", default=[4096])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--kv-gib", type=float, default=16.0)
    p.add_argument("--trace-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.decode_timeline measures CUDA graph replays: it needs a CUDA device")
    longest = max(a.ctx) + 4 * a.steps  # the prompt, then the warm-up and timed steps (twice: profiled too)
    eng = tandem_bench.lone_prompt_engine(
        a.layers, False, [longest], a.kv_gib, max_num_seqs=max(a.batches), cuda_graphs=True, async_scheduling=True
    )
    if eng.overlap is None:
        raise SystemExit("this engine has no overlapped decode (cuda_graphs + async_scheduling)")
    copy = roofline.copy_bandwidth(eng.device)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy": copy, "rows": []}
    for ctx in a.ctx:
        for b in a.batches:
            rids = tandem_bench.fill_decode_batch(eng, ctx, b)
            experts = _experts_touched_eagerly(eng)
            times = tandem_bench.decode_steps_timed(eng, a.steps, warmup=4)  # captures, then the timed steps
            wall = times.median
            step_bytes = costs.decode_bytes(eng.model_config, eng.model, b, ctx, experts, eng.dtype.itemsize)["total"]
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(a.steps):
                    eng.step()
                torch.cuda.synchronize()
            trace = (a.trace_dir or Path("/tmp")) / f"decode_timeline_ctx{ctx}_b{b}.json"
            trace.parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(trace))
            events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
            s = per_step(classify(events), a.steps)
            s["wall_us"] = wall * 1e6
            s["mean_wall_us"] = times.mean * 1e6  # bench.gpu_mid's measure (the idle start and the drain spread in)
            s["roofline"] = step_bytes / wall / copy["bytes_per_s"]
            res["rows"].append({"ctx": ctx, "batch": b, **s})
            print(report(ctx, b, s), flush=True)
            tandem_bench.clear(eng, rids)
            tandem_bench.drain(eng)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
