"""The prefill-size MoE expert kernels (kernels/moe/prefill.py) against the grouped-GEMM path, with a tile sweep.

    python -m bench.moe_prefill_sweep --out moe_prefill_sweep.json      # on the GPU (~3 min of compiles)

Kimi-Linear's expert shapes (256 experts top-8, hidden 2304, expert size 1024), bf16, routing by the sigmoid
top-k kernel on random logits (near-uniform: ~256 rows an expert at 8k tokens). Per token count:

- the grouped path as ``grouped.grouped_moe`` runs its experts part: the gather of x into expert order,
  torch's grouped GEMM (CUTLASS) for gate | up, fla's SwiGLU, the grouped GEMM for down;
- the two Triton kernels (gate-up with the gather and the SwiGLU fused; down), each swept over tiles on
  the first token count, the best few then timed at the others.

Times are GPU kernel time (torch.profiler, no launch overhead), as TFLOP/s and a fraction of the bf16 matmul
peak measured in the same run. Each configuration's output is checked against the grouped path's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch

from bench.gpu_kernels_check import kernel_ms
from bench.mid import roofline
from kernels.activation import silu_mul
from kernels.moe.grouped import grouped_gemm, moe_align
from kernels.moe.prefill import (
    DOWN_TILES,
    GATE_UP_TILES,
    GemmTiles,
    down_grouped,
    fit_stages,
    gate_up_fused,
    moe_experts_prefill,
)
from kernels.moe.triton import sigmoid_topk_route_triton

E, K, HID, INTER = 256, 8, 2304, 1024
H200_SMEM = 232448  # shared memory a block may take on the H200 (227 KB)


def _fits(t: GemmTiles, b_tiles: int) -> bool:
    """All pipeline stages in shared memory (as the kernels would fit them, ``fit_stages``) and accumulators of
    at most 128 fp32 registers a thread."""
    acc_regs = b_tiles * t.block_m * t.block_n // (t.num_warps * 32)
    return fit_stages(t, b_tiles, 2, H200_SMEM) is t and acc_regs <= 128


def candidates(b_tiles: int) -> list[GemmTiles]:
    grid = itertools.product((64, 128), (64, 128, 256), (64, 128), (4, 8), (3, 4))
    return [t for t in (GemmTiles(*c) for c in grid) if _fits(t, b_tiles)]


def _time(fn, check: torch.Tensor, flops: float, peak: float, tiles: GemmTiles | None) -> dict:
    row = {} if tiles is None else {"tiles": list(tiles.__dict__.values())}
    try:
        out = fn()
        err = ((out.float() - check.float()).abs().max() / check.float().abs().max()).item()
        ms = kernel_ms(fn, iters=10)
    except Exception as exc:  # a tile this Triton cannot compile: recorded, not fatal
        return row | {"error": repr(exc)[:200]}
    return row | {"ms": ms, "tflops": flops / ms / 1e9, "of_peak": flops / (ms * 1e-3) / peak, "max_rel_diff": err}


def workload(t: int, w13: torch.Tensor, w2: torch.Tensor, peak: float, sweep: bool, best: dict) -> dict:
    device = w13.device
    gen = torch.Generator(device=device).manual_seed(t)
    x = torch.randn(t, HID, generator=gen, device=device).to(torch.bfloat16)
    logits = torch.randn(t, E, generator=gen, device=device)
    _, ids = sigmoid_topk_route_triton(logits, None, K, True, 1.0)
    al = moe_align(ids, E)
    n = al.token.numel()
    f_gate_up, f_down = 2.0 * n * HID * 2 * INTER, 2.0 * n * INTER * HID

    def grouped_gate_up() -> torch.Tensor:
        h13 = grouped_gemm(x[al.token], w13, al.offsets)
        return silu_mul(h13[:, :INTER], h13[:, INTER:])

    a_ref = grouped_gate_up()
    y_ref = grouped_gemm(a_ref, w2, al.offsets)
    res: dict = {"tokens": t, "pairs": n, "most_rows": int(torch.diff(al.offsets, prepend=al.offsets[:1] * 0).max())}
    res["experts"] = {  # what the engine runs: grouped_moe's experts part vs moe_experts_prefill (defaults)
        "grouped path": _time(
            lambda: grouped_gemm(grouped_gate_up(), w2, al.offsets), y_ref, f_gate_up + f_down, peak, None
        ),
        "prefill kernels": _time(lambda: moe_experts_prefill(x, al, w13, w2), y_ref, f_gate_up + f_down, peak, None),
    }
    res["grouped"] = {
        "gate_up (gather + grouped_mm + swiglu)": _time(grouped_gate_up, a_ref, f_gate_up, peak, None),
        "gather only": _time(lambda: x[al.token], x[al.token], 0.0, peak, None),
        "down (grouped_mm)": _time(lambda: grouped_gemm(a_ref, w2, al.offsets), y_ref, f_down, peak, None),
    }
    for name, fn, ref, flops, b_tiles in (
        ("gate_up", lambda tl_: gate_up_fused(x, al, w13, tl_), a_ref, f_gate_up, 2),
        ("down", lambda tl_: down_grouped(a_ref, al, w2, tl_), y_ref, f_down, 1),
    ):
        default = GATE_UP_TILES if name == "gate_up" else DOWN_TILES
        tiles = candidates(b_tiles) if sweep else [default, *best.get(name, [])]
        rows = [_time(lambda f=fn, t_=t_: f(t_), ref, flops, peak, t_) for t_ in dict.fromkeys(tiles)]
        ok = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
        first = _time(lambda f=fn, d=default: f(d), ref, flops, peak, default)
        res[name] = {"default": first, "best": ok[:5], "rows": rows}
        if sweep:
            best[name] = [GemmTiles(*r["tiles"]) for r in ok[:4]]
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="*", default=[8192, 32768])
    p.add_argument("--no-sweep", action="store_true", help="time the default tiles only (no compiles of others)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device("cuda")
    peak = roofline.matmul_peak_flops(device)["flops_per_s"]
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(E, 2 * INTER, HID, generator=gen, device=device) * HID**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, HID, INTER, generator=gen, device=device) * INTER**-0.5).to(torch.bfloat16)
    res: dict = {"device": torch.cuda.get_device_name(), "matmul_peak_flops": peak, "workloads": []}
    best: dict = {}
    for j, t in enumerate(a.tokens):
        r = workload(t, w13, w2, peak, sweep=j == 0 and not a.no_sweep, best=best)
        res["workloads"].append(r)
        g = r["grouped"]
        line = f"== T={t} ({r['pairs']} pairs, most rows {r['most_rows']}): grouped path"
        for key, v in g.items():
            line += f" | {key} {v.get('ms', float('nan')):.3f} ms ({v.get('of_peak', 0):.0%})"
        print(line, flush=True)
        print(
            "   experts as the engine runs them: "
            + " | ".join(
                f"{k} {v.get('ms', float('nan')):.3f} ms ({v.get('of_peak', 0):.0%})" for k, v in r["experts"].items()
            ),
            flush=True,
        )
        for name in ("gate_up", "down"):
            d, b = r[name]["default"], r[name]["best"][0]
            print(
                f"   {name}: default {d.get('ms', float('nan')):.3f} ms ({d.get('of_peak', 0):.0%}); best "
                f"{b['ms']:.3f} ms ({b['of_peak']:.0%}) tiles m/n/k/warps/stages {b['tiles']}, "
                f"max rel diff {b['max_rel_diff']:.2g}",
                flush=True,
            )
        if a.out:
            a.out.write_text(json.dumps(res, indent=1))
    print(f"== total wall time {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
