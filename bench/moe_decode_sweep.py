"""Tile sweep of the decode-size MoE expert kernels (kernels/moe/decode.py) under uniform and skewed routing.

    python -m bench.moe_decode_sweep --out moe_decode_sweep.json      # on the GPU (~2 min of compiles)
    python -m bench.moe_decode_sweep --pair-rows --out moe_one_row.json --env-out one_row_tiles.env

``--pair-rows``: one token's experts as pair rows (a batch-1 step, kernels/moe/decode.py without its align),
each kernel's own tiles swept with the other kernel at its default, timed per kernel over 8 sets of 9 experts
(8 routed + the folded shared one) in turn, so no expert's weights are still in L2 from the last call. It
prints the best pair as ``TANDEM_MOE_ONE_ROW_TILES=...`` (and writes it to ``--env-out``) for a step-time A / B.

Why skewed: in the mid-shape model's decode steps (random weights) 64 tokens x top-8 hit ~95 of the 256
experts with up to ~40 rows on one expert, and the two expert kernels stream the hit experts' weights at ~84 %
of copy bandwidth there, against ~93 % in the uniform-routing check (173+ experts hit, a few rows each). An
expert with more than BLOCK_M rows makes its programs walk the weights once per row block. The skewed case
adds a shared per-expert bias (N(0, 1)) to the router logits, which hits ~95 experts at T=64 (measured on the
host). Each configuration is timed by the profiler's GPU kernel time (no launch overhead), checked against
the default tiles' output (``decode_tiles``), and reported as a fraction of the device copy bandwidth (bytes =
the hit experts' weights, read once). The recorded run (docs/results/moe_decode_sweep_skew.json) predates
``decode_tiles``: its "default" rows are the 16 x 32 tiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path

import torch

from bench.gpu_kernels_check import kernel_ms
from bench.kernels_check.report import kernel_us_by_name
from bench.mid import roofline
from kernels.moe.align import moe_align_triton
from kernels.moe.decode import decode_gemm_tiles, decode_tiles, moe_experts_decode

E, K, HID, INTER = 256, 8, 2304, 1024


def _routing(t: int, skew: float, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    bias = torch.randn(E, generator=gen, device=device) * skew
    return (torch.randn(t, E, generator=gen, device=device) + bias).topk(K).indices


def sweep(t: int, skew: float, device: torch.device, copy_bw: float, w13: torch.Tensor, w2: torch.Tensor) -> dict:
    gen = torch.Generator(device=device).manual_seed(t)
    ids = _routing(t, skew, gen, device)
    counts = torch.bincount(ids.flatten(), minlength=E)
    hit, most = int((counts > 0).sum()), int(counts.max())
    x = torch.randn(t, HID, generator=gen, device=device).to(torch.bfloat16)
    al = moe_align_triton(ids, E)
    nbytes = hit * 3 * HID * INTER * 2
    d, _ = decode_tiles(t)  # both kernels' tiles are the same here
    default_cfg = (d.block_m, d.block_n, d.block_k, d.num_warps)  # as moe_experts_decode picks them
    want = moe_experts_decode(x, al, w13, w2, d, d)
    rows = []
    for bm, bn, bk, nw in itertools.product((16, 32, 64), (16, 32, 64), (64, 128, 256), (4, 8)):
        if bm * bk > 16384 or bn * bk > 16384:
            continue  # tiles past 32 KB of bf16 a load: register spills
        cfg = {"block_m": bm, "block_n": bn, "block_k": bk, "warps": nw}
        try:
            tiles = decode_gemm_tiles(bm, bn, bk, nw)
            out = moe_experts_decode(x, al, w13, w2, tiles, tiles)
            err = (out.float() - want.float()).abs().max().item()
            ms = kernel_ms(lambda: moe_experts_decode(x, al, w13, w2, tiles, tiles))  # noqa: B023
        except Exception as exc:  # a tile this Triton cannot compile: recorded, not fatal
            rows.append({**cfg, "error": repr(exc)[:200]})
            continue
        rows.append({**cfg, "ms": ms, "roofline": nbytes / (ms * 1e-3) / copy_bw, "max_abs_diff": err})
    ok = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    default = next(r for r in ok if (r["block_m"], r["block_n"], r["block_k"], r["warps"]) == default_cfg)
    res = {"tokens": t, "skew": skew, "experts_hit": hit, "most_rows": most}
    return res | {"default": default, "best": ok[:5], "rows": rows}


ONE_ROW_SETS, ONE_ROW_PAIRS = 8, 9


def sweep_pair_rows(device: torch.device, copy_bw: float, w13: torch.Tensor, w2: torch.Tensor) -> dict:
    """Each kernel's tiles at one token (pair rows), the other kernel at its default."""
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, HID, generator=gen, device=device).to(torch.bfloat16)
    id_sets = [torch.randperm(E, generator=gen, device=device)[:ONE_ROW_PAIRS] for _ in range(ONE_ROW_SETS)]
    base = dict(zip(("gate_up", "down"), decode_tiles(1), strict=True))
    want = moe_experts_decode(x, None, w13, w2, **base, ids=id_sets[0])
    nbytes = {"gate_up": ONE_ROW_PAIRS * 2 * INTER * HID * 2, "down": ONE_ROW_PAIRS * HID * INTER * 2}
    res: dict = {"pairs": ONE_ROW_PAIRS, "default": {k: dataclasses.asdict(v) for k, v in base.items()}, "kernels": {}}
    for kernel in ("gate_up", "down"):
        rows = []
        for bn, bk, nw in itertools.product((16, 32, 64), (128, 256, 512), (2, 4, 8)):
            if bn * bk > 16384:
                continue  # past 32 KB of bf16 a load: register spills
            tiles = base | {kernel: decode_gemm_tiles(16, bn, bk, nw)}
            cfg = {"block_n": bn, "block_k": bk, "warps": nw}
            try:
                out = moe_experts_decode(x, None, w13, w2, **tiles, ids=id_sets[0])
                err = (out.float() - want.float()).abs().max().item()
                calls = lambda: [moe_experts_decode(x, None, w13, w2, **tiles, ids=i) for i in id_sets]  # noqa: B023
                by_name = kernel_us_by_name(calls, 10)
            except Exception as exc:  # a tile this Triton cannot compile: recorded, not fatal
                rows.append({**cfg, "error": repr(exc)[:200]})
                continue
            us = sum(v for k, v in by_name.items() if f"_{kernel}_kernel" in k) / ONE_ROW_SETS
            rows.append({**cfg, "us": us, "roofline": nbytes[kernel] / (us * 1e-6) / copy_bw, "max_abs_diff": err})
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        mine = base[kernel]
        default = next(
            r for r in ok if (r["block_n"], r["block_k"], r["warps"]) == (mine.block_n, mine.block_k, mine.num_warps)
        )
        res["kernels"][kernel] = {"default": default, "best": ok[:5], "rows": rows}
        b = ok[0]
        print(
            f"== T=1 pair rows, {kernel}: default {default['us']:.2f} us ({default['roofline']:.0%}); best "
            f"{b['us']:.2f} us ({b['roofline']:.0%}) n/k/warps {b['block_n']}/{b['block_k']}/{b['warps']}, "
            f"max diff {b['max_abs_diff']:.3g}",
            flush=True,
        )
    best = {k: res["kernels"][k]["best"][0] for k in ("gate_up", "down")}
    res["env"] = ",".join(f"{b['block_n']}/{b['block_k']}/{b['warps']}" for b in best.values())
    print(f"TANDEM_MOE_ONE_ROW_TILES={res['env']}", flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="*", default=[64, 16])
    p.add_argument("--skews", type=float, nargs="*", default=[0.0, 1.0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--pair-rows", action="store_true", help="one token: each kernel's tiles (see above)")
    p.add_argument("--env-out", type=Path, default=None, help="with --pair-rows: write the best tiles' env value")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device("cuda")
    copy_bw = roofline.copy_bandwidth(device)["bytes_per_s"]
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(E, 2 * INTER, HID, generator=gen, device=device) * HID**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, HID, INTER, generator=gen, device=device) * INTER**-0.5).to(torch.bfloat16)
    res = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": copy_bw, "workloads": []}
    if a.pair_rows:
        res["pair_rows"] = sweep_pair_rows(device, copy_bw, w13, w2)
        if a.env_out:
            a.env_out.write_text(res["pair_rows"]["env"] + "\n")
        if a.out:
            a.out.write_text(json.dumps(res, indent=1))
        print(f"== total wall time {time.perf_counter() - t0:.1f} s", flush=True)
        return 0
    for t, skew in itertools.product(a.tokens, a.skews):
        r = sweep(t, skew, device, copy_bw, w13, w2)
        res["workloads"].append(r)
        d, b = r["default"], r["best"][0]
        print(
            f"== T={t} skew {skew}: {r['experts_hit']} experts hit (most rows {r['most_rows']}); default "
            f"{d['ms'] * 1e3:.1f} us ({d['roofline']:.0%}); best {b['ms'] * 1e3:.1f} us ({b['roofline']:.0%}) "
            f"m/n/k/warps {b['block_m']}/{b['block_n']}/{b['block_k']}/{b['warps']}, max diff {b['max_abs_diff']:.3g}",
            flush=True,
        )
        if a.out:
            a.out.write_text(json.dumps(res, indent=1))
    print(f"== total wall time {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
