"""Where the GPU waited: idle gaps between device work in a torch profiler trace, and what the host did then.

    python -m bench.mid.gaps trace.json[.gz] [--min-gap-us 100] [--top 10]

A step whose wall time exceeds its kernel time has the difference somewhere: before the first kernel (the
host preparing the step), between kernels (the host enqueueing slower than the GPU runs, or a wait on another
rank), or after the last one. The trace (``torch.profiler.profile.export_chrome_trace``) has both timelines on
one clock; this merges the device intervals and lists the largest gaps with the host ops that overlap them.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
from pathlib import Path
from typing import Any

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "user_annotation", "python_function")


def load_events(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def summarise(events: list[dict[str, Any]], min_gap_us: float = 100.0, top: int = 10) -> dict[str, Any]:
    """Span, device busy time and the largest idle gaps (with the host ops during each), in microseconds."""
    dev = merged([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in DEVICE_CATS])
    host = [e for e in events if e.get("cat") in HOST_CATS]
    if not dev:
        return {"device_events": 0}
    t0 = min([dev[0][0]] + [e["ts"] for e in host])
    t1 = max([dev[-1][1]] + [e["ts"] + e["dur"] for e in host])
    busy = sum(b - a for a, b in dev)
    gaps = [(t0, dev[0][0], "before the first device op")]
    gaps += [(a1, b0, "between device ops") for (_, a1), (b0, _) in itertools.pairwise(dev)]
    gaps.append((dev[-1][1], t1, "after the last device op"))
    gaps = [g for g in gaps if g[1] - g[0] >= min_gap_us]
    gaps.sort(key=lambda g: g[0] - g[1])
    out = []
    for a, b, where in gaps[:top]:
        seen: dict[str, float] = {}
        for e in host:
            ov = _overlap(a, b, e["ts"], e["ts"] + e["dur"])
            if ov > 0:
                seen[e["name"]] = seen.get(e["name"], 0.0) + ov
        ops = sorted(seen.items(), key=lambda kv: -kv[1])[:6]
        out.append({"at_us": a - t0, "gap_us": b - a, "where": where, "host_ops": [[n, round(v, 1)] for n, v in ops]})
    idle = (t1 - t0) - busy
    return {
        "device_events": len(dev),
        "span_us": t1 - t0,
        "device_busy_us": busy,
        "device_idle_us": idle,
        "idle_in_gaps_over_min_us": sum(g[1] - g[0] for g in gaps),
        "gaps": out,
    }


def report(name: str, s: dict[str, Any]) -> str:
    if not s.get("device_events"):
        return f"{name}: no device events in the trace"
    lines = [
        f"{name}: span {s['span_us'] / 1e3:.1f} ms, device busy {s['device_busy_us'] / 1e3:.1f} ms, "
        f"idle {s['device_idle_us'] / 1e3:.1f} ms ({s['idle_in_gaps_over_min_us'] / 1e3:.1f} ms in the gaps below)"
    ]
    for g in s["gaps"]:
        ops = ", ".join(f"{n} {v / 1e3:.1f}" for n, v in g["host_ops"])
        lines.append(f"  {g['gap_us'] / 1e3:7.2f} ms at {g['at_us'] / 1e3:7.1f} ms ({g['where']}): {ops}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", type=Path, nargs="+")
    p.add_argument("--min-gap-us", type=float, default=100.0)
    p.add_argument("--top", type=int, default=10)
    a = p.parse_args(argv)
    for t in a.traces:
        print(report(t.name, summarise(load_events(t), a.min_gap_us, a.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
