"""Launch-tile sweep of fla-core's fused recurrent KDA kernel (KDA decode) through kernels/kda/recurrent_launch.py.

    python -m bench.kda_recurrent_sweep --out kda_recurrent_sweep.json     # on the GPU (about a minute of compiles)

Kimi-Linear's KDA decode: 32 heads x 128 (K = V), one token per sequence. For each batch N: bf16 q/k/v (L2-normed
in the kernel), fp32 log-space gate g = -softplus(randn), bf16 beta in (0, 1), an fp32 state pool of 2N+7 slots
read and written in place through a random subset of its slots. Every ``RecurrentTile`` (BV x warps x stages)
is timed: the launch captured in a CUDA graph (as the engine runs decode), CUDA events around each replay, the
L2 flushed before each (a 256 MiB memset: other layers evict it between two steps of one layer), median of
``--runs``. The pool is not reset: these are repeated decode steps (the update is a contraction, so the state
stays finite; checked). Bytes: the state read + written (2 N H K V x 4) plus q, k, v, g, beta, o, slot indices.
The ratio is against the device copy bandwidth measured here (bench/mid/roofline.py, 1 GiB, best of 10).
Each tile's one step from a copy of the starting pool is compared with fla's own launch (its wrapper,
BV 32 / 4 warps / 2 stages); fla's wrapper is timed beside it (it also zero-fills its output).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
from importlib.metadata import version
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.mid import roofline
from kernels.kda.recurrent_launch import DEFAULT_RECURRENT_TILE, RecurrentTile, launch_fused_recurrent_kda

BVS, WARPS, STAGES = (8, 16, 32, 64, 128), (1, 2, 4, 8), (1, 2, 3)


def _median_ms(fn, flush: torch.Tensor, runs: int, warmup: int = 10) -> float:
    """Median milliseconds of fn() over `runs` calls, the L2 flushed before each (CUDA events)."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def _graphed(fn):
    """fn captured in a CUDA graph (after one eager call, which compiles); returns the replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _workload(n: int, heads: int, dim: int, device: torch.device) -> dict:
    gen = torch.Generator(device=device).manual_seed(n)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    q, k, v = (randn(n, 1, heads, dim).to(torch.bfloat16) for _ in range(3))  # fla layout [B=N, T=1, H, D]
    g = -F.softplus(randn(n, 1, heads, dim))
    beta = torch.sigmoid(randn(n, 1, heads)).to(torch.bfloat16)
    num_slots = 2 * n + 7
    pool = randn(num_slots, heads, dim, dim) * 0.1
    idx = torch.randperm(num_slots, generator=gen, device=device)[:n].to(torch.int32)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "pool": pool, "idx": idx}


def _bytes(n: int, heads: int, dim: int) -> int:
    state = 2 * n * heads * dim * dim * 4
    qkv_o = 4 * n * heads * dim * 2  # q, k, v read and o written, bf16
    return state + qkv_o + n * heads * dim * 4 + n * heads * 2 + n * 4  # + g fp32, beta bf16, slot indices


def sweep(n: int, heads: int, dim: int, device: torch.device, copy_bw: float, runs: int) -> dict:
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    w = _workload(n, heads, dim, device)
    q, k, v, g, beta, pool, idx = (w[x] for x in ("q", "k", "v", "g", "beta", "pool", "idx"))
    start = pool.clone()  # every tile's correctness step starts here
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    nbytes = _bytes(n, heads, dim)

    def fla(p: torch.Tensor) -> torch.Tensor:
        kw = dict(initial_state=p, inplace_final_state=True, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True)
        return fused_recurrent_kda_fwd(q=q, k=k, v=v, g=g, beta=beta, **kw)[0]

    def ours(tile: RecurrentTile, p: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return launch_fused_recurrent_kda(q, k, v, g, beta, p, idx, None, None, tile, out=out)

    ref_pool = start.clone()
    ref_o = fla(ref_pool)

    def perf(ms: float) -> dict:
        bps = nbytes / ms * 1e3
        return {"ms": ms, "gb_per_s": bps / 1e9, "copy_fraction": bps / copy_bw}

    rows = []
    for bv, warps, stages in itertools.product(BVS, WARPS, STAGES):
        tile = RecurrentTile(bv, warps, stages)
        cfg = {"bv": bv, "warps": warps, "stages": stages, "default": tile == DEFAULT_RECURRENT_TILE}
        out = torch.empty_like(v)
        try:
            check_pool = start.clone()
            err_o = (ours(tile, check_pool).float() - ref_o.float()).abs().max().item()
            err_state = (check_pool - ref_pool).abs().max().item()
            replay = _graphed(functools.partial(ours, tile, pool, out))
            ms = _median_ms(replay, flush, runs)
        except Exception as e:  # fails to compile (registers / shared memory) or to launch
            rows.append({**cfg, "error": repr(e)[:300]})
            print(f"N={n} {cfg} error {rows[-1]['error'][:120]}", flush=True)
            continue
        assert torch.isfinite(out).all(), f"non-finite output after repeated steps with {tile}"
        rows.append({**cfg, **perf(ms), "max_abs_err_o": err_o, "max_abs_err_state": err_state})
    assert torch.isfinite(pool).all(), "non-finite state pool after the sweep"
    fla_ms = _median_ms(_graphed(lambda: fla(pool)), flush, runs)
    ok = [r for r in rows if "ms" in r]
    return {
        "batch": n,
        "bytes": nbytes,
        "default": next((r for r in ok if r["default"]), None),
        "fla_wrapper": perf(fla_ms),
        "best": min(ok, key=lambda r: r["ms"], default=None),
        "rows": rows,
    }


def _table(r: dict, top: int = 5) -> str:
    lines = [
        f"N={r['batch']} ({r['bytes'] / 1e6:.2f} MB a step)",
        "",
        "| config | bv | warps | stages | us | GB/s | of copy | max err o / state |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def line(name: str, x: dict) -> str:
        cells = [name, x.get("bv", "32"), x.get("warps", "4"), x.get("stages", "2"), f"{x['ms'] * 1e3:.1f}"]
        cells += [f"{x['gb_per_s']:.0f}", f"{x['copy_fraction']:.0%}"]
        cells.append(f"{x['max_abs_err_o']:.1e} / {x['max_abs_err_state']:.1e}" if "max_abs_err_o" in x else "-")
        return "| " + " | ".join(str(c) for c in cells) + " |"

    for i, x in enumerate(sorted((x for x in r["rows"] if "ms" in x), key=lambda x: x["ms"])[:top]):
        lines.append(line(f"#{i + 1}" + (" (default)" if x["default"] else ""), x))
    if r["default"] is not None:
        lines.append(line("default", r["default"]))
    lines.append(line("fla wrapper", r["fla_wrapper"]))
    failed = sum("error" in x for x in r["rows"])
    return "\n".join(lines + ([f"\n{failed} configs failed (errors in the JSON)"] if failed else []))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", nargs="*", type=int, default=[1, 16, 64])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--dim", type=int, default=128, help="K = V")
    p.add_argument("--runs", type=int, default=100, help="timed runs per config (median; at least 50)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.kda_recurrent_sweep needs a CUDA GPU (the sweep times compiled Triton kernels)", file=sys.stderr)
        return 2
    if a.runs < 50:
        p.error("--runs must be at least 50")
    device = torch.device("cuda")
    copy_bw = roofline.copy_bandwidth(device, nbytes=1 << 30)["bytes_per_s"]
    res = {
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": version("triton"), "fla-core": version("fla-core")},
        "heads": a.heads,
        "dim": a.dim,
        "runs": a.runs,
        "copy_bytes_per_s": copy_bw,
        "workloads": [],
    }
    print(f"{res['device']}: copy bandwidth {copy_bw / 1e9:.0f} GB/s; {res['versions']}", flush=True)
    for n in a.batches:
        r = sweep(n, a.heads, a.dim, device, copy_bw, a.runs)
        res["workloads"].append(r)
        print("\n" + _table(r) + "\n", flush=True)
        if a.out:
            a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
