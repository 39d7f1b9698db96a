"""Shared by the MoE GEMM benches (bench/moe_gate_up_tma.py, bench/moe_down_tma.py): time named ways of
computing one GEMM on the GPU against a reference output, and the command line / table around them."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from bench.gpu_kernels_check import kernel_ms
from bench.mid import roofline


def time_paths(paths: dict[str, Callable[[], torch.Tensor]], want: torch.Tensor, flops: float, peak: float) -> dict:
    """GPU kernel ms, fraction of ``peak`` and largest difference relative to ``want`` per path; a path this
    Triton cannot compile (a form, shared memory) is recorded with its error, not fatal."""
    out = {}
    for name, fn in paths.items():
        try:
            err = ((fn().float() - want.float()).abs().max() / want.float().abs().max()).item()
            ms = kernel_ms(fn, iters=10)
        except Exception as exc:
            out[name] = {"error": repr(exc)[:300]}
            continue
        out[name] = {"ms": ms, "of_peak": flops / (ms * 1e-3) / peak, "max_rel_diff": err}
    return out


def main(doc: str, weight: Callable[[torch.device], torch.Tensor], workload: Callable, argv: list[str] | None) -> int:
    """``--tokens`` / ``--out``; ``workload(tokens, weight, peak) -> {"tokens", "pairs", "paths"}`` per size,
    printed as a markdown table and written as JSON with the device and the matmul peak measured here."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    device = torch.device("cuda")
    peak = roofline.matmul_peak_flops(device)["flops_per_s"]
    w = weight(device)
    res: dict = {"device": torch.cuda.get_device_name(), "matmul_flops_per_s": peak, "runs": []}
    print(f"{res['device']}, bf16 matmul {peak / 1e12:.0f} TFLOP/s\n| tokens | path | ms | of peak | max rel diff |")
    print("|---|---|---|---|---|")
    for t in a.tokens:
        row = workload(t, w, peak)
        res["runs"].append(row)
        for name, r in row["paths"].items():
            if "ms" in r:
                print(f"| {t} | {name} | {r['ms']:.3f} | {r['of_peak']:.0%} | {r['max_rel_diff']:.2g} |", flush=True)
            else:
                print(f"| {t} | {name} | {r['error']} | | |", flush=True)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0
