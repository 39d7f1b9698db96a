"""A decode step's kernels by name and grid, from a chrome trace of ``steps`` steps (``bench.decode_timeline
--trace-dir``): time a step, launches a step, time a launch, costliest first. The grid tells the launches of one
kernel apart (the skinny GEMM's 393 programs are KDA's in_proj, 288 its o_proj, ...).

    python -m bench.trace_kernels TRACE.json[.gz] --steps 10 [--top 40]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path


def kernel_table(events: list[dict], steps: int) -> list[tuple[float, int, float, str, tuple[int, ...]]]:
    """(us a step, launches a step, us a launch, name, grid) for each kernel name and grid, costliest first."""
    acc: dict[tuple[str, tuple[int, ...]], list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            key = (e["name"], tuple(e.get("args", {}).get("grid", ())))
            acc[key][0] += 1
            acc[key][1] += float(e["dur"])
    rows = [(us / steps, n // steps, us / n, name, grid) for (name, grid), (n, us) in acc.items()]
    return sorted(rows, key=lambda r: -r[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.trace_kernels", description=__doc__.splitlines()[0])
    p.add_argument("trace", type=Path)
    p.add_argument("--steps", type=int, required=True, help="steps the trace holds (decode_timeline's --steps)")
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args(argv)
    opener = gzip.open if a.trace.suffix == ".gz" else open
    with opener(a.trace, "rt") as f:
        rows = kernel_table(json.load(f)["traceEvents"], a.steps)
    print(f"{sum(r[0] for r in rows):.1f} us of kernels a step, {sum(r[1] for r in rows)} launches")
    for us, n, each, name, grid in rows[: a.top]:
        print(f"{us:8.1f} us {n:3d} x {each:7.2f}  {name[:72]} {grid}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
