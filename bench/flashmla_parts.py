"""FlashMLA's dense decode with its own split planner vs Tandem's (kernels/flashmla/plan.py) at several part
counts, fewest blocks a part and the auto policy, on the H200 at Kimi-Linear's MLA shape: the sweep that set
``AUTO_MIN_BLOCKS``.

    python -m kernels.flashmla.build && python -m bench.flashmla_parts --out flashmla_parts.json   # GPU, ~1 min
    TRITON_INTERPRET=1 python -m bench.flashmla_parts --plans-only       # CPU: the plans' split counts alone

Workloads: batches x contexts, every sequence at the full context ("equal") and a context drawn per sequence
in [1, ctx] ("mixed"; bench/flashmla_check.py's workloads). Speed: us per decode launch — planning kernel, split
kernel and combine — as ``ITERS`` launches captured in one CUDA graph (no host launch cost, as in the decode
step's graphs), the median of several replays. Correctness: max |diff| of each plan's output against FlashMLA's
with its own plan (bf16 rounding apart, they should agree); our plans also pass naive_plan.plan_errors.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from bench.flashmla_check import RANK, SCALE, workload
from bench.graph_time import graph_us
from kernels.flashmla.naive_plan import naive_plan, plan_errors

ITERS = 20  # launches per graph replay
MAX_DIFF = 2e-2  # vs FlashMLA's own plan: bf16 outputs of two summation orders
VARIANTS_HELP = "flashmla (its own planner), auto (the policy), N parts, or mK (all parts, >= K blocks each)"


def _parts_env(variant: str) -> tuple[str, int | None, int | None]:
    """(TANDEM_FLASHMLA_PARTS to capture under, num_parts, min_blocks to pass) for a variant: flashmla, auto,
    N (parts), or mK (every part of the grid, at least K blocks a part)."""
    if variant in ("flashmla", "auto"):
        return variant, None, None
    if variant.startswith("m"):
        return "auto", 132, int(variant[1:])
    return "auto", int(variant), 1


def run_workload(batch: int, ctx: int, mixed: bool, variants: list[str], device: torch.device) -> dict:
    from kernels.flashmla.decode import DecodeSchedule, flashmla_decode_fwd

    q_lat, q_pe, latent, tables, lens = workload(batch, ctx, mixed, device)
    q = torch.cat([q_lat, q_pe], -1).contiguous()  # FlashMLA's query buffer: no concatenation in the timing
    ql, qp = q[..., :RANK], q[..., RANK:]
    row: dict = {"batch": batch, "ctx": ctx, "contexts": "mixed" if mixed else "equal", "variants": {}}
    os.environ["TANDEM_FLASHMLA_PARTS"] = "flashmla"
    own = flashmla_decode_fwd(ql, qp, latent, tables, lens, SCALE, q=q).float()  # what every variant must match
    for variant in variants:
        env, parts, min_blocks = _parts_env(variant)
        os.environ["TANDEM_FLASHMLA_PARTS"] = env  # read when a call plans: eagerly and while capturing

        def call(sched: DecodeSchedule | None = None, parts: int | None = parts, mb: int | None = min_blocks):
            return flashmla_decode_fwd(
                ql, qp, latent, tables, lens, SCALE, schedule=sched, q=q, num_parts=parts, min_blocks=mb
            )

        sched = DecodeSchedule()
        out = call(sched).float()
        meta, num_splits = sched.plan  # the plan this call used: ours, or FlashMLA's
        res = {
            "us": graph_us(call, ITERS),
            "max_diff": (out - own).abs().max().item(),
            "splits": int(num_splits[-1]),
            "max_splits": int((num_splits[1:] - num_splits[:-1]).max()),
            "parts_used": int((meta[:, 0] < batch).sum()),
        }
        if variant != "flashmla":
            res["plan_errors"] = plan_errors(meta, num_splits, lens.tolist(), meta.shape[0])[:3]
        row["variants"][variant] = res
    os.environ.pop("TANDEM_FLASHMLA_PARTS", None)
    return row


def plans_only(batch: int, ctx: int, mixed: bool, variants: list[str], grid: int) -> dict:
    """The CPU path: each variant's plan (ours on the device kernel, FlashMLA's transcribed) and its splits."""
    from kernels.flashmla import plan
    from kernels.flashmla.naive_plan import flashmla_reference_plan

    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(1, ctx + 1, (batch,), generator=gen) if mixed else torch.full((batch,), ctx)
    lens = lens.to(torch.int32)
    row: dict = {"batch": batch, "ctx": ctx, "contexts": "mixed" if mixed else "equal", "variants": {}}
    for variant in variants:
        if variant == "flashmla":
            meta, num_splits = flashmla_reference_plan(lens.tolist(), grid)
        else:
            os.environ["TANDEM_FLASHMLA_PARTS"] = "auto"
            _, parts, mb = _parts_env(variant)
            parts = plan.num_parts_for(batch, grid) if variant == "auto" else min(parts, grid)
            mb = plan.min_blocks_setting() if mb is None else mb
            meta, num_splits = plan.even_blocks_plan(lens, parts, grid, mb)
            want = naive_plan(lens.tolist(), parts, grid, mb)
            assert torch.equal(meta, want[0]) and torch.equal(num_splits, want[1]), (batch, ctx, variant)
        errs = plan_errors(meta, num_splits, lens.tolist(), grid)
        row["variants"][variant] = {"splits": int(num_splits[-1]), "plan_errors": errs[:3]}
    os.environ.pop("TANDEM_FLASHMLA_PARTS", None)
    return row


def _print_table(rows: list[dict], variants: list[str], key: str) -> None:
    print(f"{'workload':>16} " + " ".join(f"{v:>9}" for v in variants) + ("   best  auto/own" if key == "us" else ""))
    for r in rows:
        vs = r["variants"]
        cells = " ".join(f"{vs[v][key]:>9.1f}" if key == "us" else f"{vs[v][key]:>9d}" for v in variants)
        tail = ""
        if key == "us":
            best = min(vs, key=lambda v: vs[v]["us"])
            ratio = vs["auto"]["us"] / vs["flashmla"]["us"] if {"auto", "flashmla"} <= set(vs) else float("nan")
            tail = f" {best:>6} {ratio:>8.2f}"
        print(f"{r['batch']:>4}x{r['ctx']:<6} {r['contexts']:>5} {cells}{tail}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16, 32, 64])
    p.add_argument("--contexts", type=int, nargs="*", default=[4096, 32768])
    p.add_argument(
        "--variants",
        nargs="*",
        default=["flashmla", "4", "8", "16", "32", "66", "132", "m2", "m4", "m8", "m16", "auto"],
    )
    p.add_argument("--plans-only", action="store_true", help="no attention: each plan's split count (runs on CPU)")
    p.add_argument("--grid", type=int, default=132, help="--plans-only: FlashMLA's parts (the H200's at 32 heads)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    for v in a.variants:
        if v not in ("flashmla", "auto") and not v.isdigit() and not (v[:1] == "m" and v[1:].isdigit()):
            p.error(f"variant {v!r}: {VARIANTS_HELP}")
    work = [(b, c, m) for c in a.contexts for b in a.batches for m in (False, True)]
    t0 = time.perf_counter()
    if a.plans_only:
        rows = [plans_only(b, c, m, a.variants, a.grid) for b, c, m in work]
        _print_table(rows, a.variants, "splits")
    else:
        from kernels.flashmla.build import load_flashmla
        from kernels.flashmla.plan import flashmla_grid_parts

        device = torch.device("cuda")
        load_flashmla(verbose=False)
        grid = flashmla_grid_parts(device, 32)
        variants = [v for v in a.variants if not v.isdigit() or int(v) <= grid]
        print(f"us per decode launch (plan + split kernel + combine), {ITERS} a CUDA graph; grid {grid} parts")
        rows = []
        for b, c, m in work:
            rows.append(run_workload(b, c, m, variants, device))
            _print_table(rows[-1:], variants, "us")
        a.variants = variants
    bad = [
        (r["batch"], r["ctx"], r["contexts"], v)
        for r in rows
        for v, res in r["variants"].items()
        if res.get("plan_errors") or res.get("max_diff", 0.0) > MAX_DIFF
    ]
    print(f"{time.perf_counter() - t0:.1f} s;", "all plans valid" if not bad else f"bad: {bad}")
    if a.out:
        a.out.write_text(json.dumps({"iters": ITERS, "variants": a.variants, "rows": rows}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
