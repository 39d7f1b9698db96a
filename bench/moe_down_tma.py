"""The MoE down GEMM with both operands through TMA (kernels/moe/prefill_tma.down_tma) against torch's
grouped_mm and the pointer kernel (kernels/moe/prefill.down_grouped), on the GPU. (The engine runs the TMA
kernel below 16k tokens and grouped_mm from there, as this measured: docs/PERFORMANCE.md, seventeenth session.)

    python -m bench.moe_down_tma --tokens 8192 32768 --out moe_down_tma.json

Kimi-Linear's expert shapes (256 experts, top-8, hidden 2304, expert size 1024), bf16, random routing as in
``bench/moe_prefill_sweep.py``: the sorted [T*k, I] activations into [T*k, H]. GPU kernel time of the GEMM
(tile maps built once, outside), useful FLOPs against the bf16 matmul peak measured in the run, the output's
largest difference relative to grouped_mm's. TMA tiles: the engine's down tile (128 x 256 x 64, 8 warps) at 3
and 4 stages, 128 x 128 at 4, 256-row tiles (one tile for most experts' ~256 rows at 8k: each weight tile
read once) at 3. ``TANDEM_MOE_DOWN_IMPL=grouped_mm|auto`` with ``bench/gpu_mid.py`` gives the end-to-end A / B.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.gpu_kernels_check import kernel_ms
from bench.mid import roofline
from bench.moe_prefill_sweep import HID, INTER, E, K
from kernels.moe.grouped import grouped_gemm, moe_align
from kernels.moe.prefill import DOWN_TILES, GemmTiles, down_grouped
from kernels.moe.prefill_tma import down_tma
from kernels.moe.tiles import tiles_of
from kernels.moe.triton import sigmoid_topk_route_triton

TMA_TILES = {
    "128 x 256, 3 stages": GemmTiles(128, 256, 64, num_warps=8, num_stages=3),
    "128 x 256, 4 stages": DOWN_TILES,
    "128 x 128, 4 stages": GemmTiles(128, 128, 64, num_warps=8, num_stages=4),
    "256 x 128, 3 stages": GemmTiles(256, 128, 64, num_warps=8, num_stages=3),
}


def workload(t: int, w2: torch.Tensor, peak: float) -> dict:
    device = w2.device
    gen = torch.Generator(device=device).manual_seed(t)
    _, ids = sigmoid_topk_route_triton(torch.randn(t, E, generator=gen, device=device), None, K, True, 1.0)
    al = moe_align(ids, E)
    n = al.token.numel()
    a = (torch.randn(n, INTER, generator=gen, device=device) * 0.5).to(torch.bfloat16)
    flops = 2.0 * n * INTER * HID
    want = grouped_gemm(a, w2, al.offsets)
    maps = {m: tiles_of(al, n, m, None) for m in {t_.block_m for t_ in (DOWN_TILES, *TMA_TILES.values())}}
    paths = {
        "grouped_mm (engine)": lambda: grouped_gemm(a, w2, al.offsets),
        "pointer 128 x 256, 4 stages": lambda: down_grouped(a, al, w2, DOWN_TILES, maps[DOWN_TILES.block_m]),
    }
    for name, tiles in TMA_TILES.items():
        paths[f"tma {name}"] = lambda tiles=tiles: down_tma(a, al, w2, tiles, maps[tiles.block_m])
    row: dict = {"tokens": t, "pairs": n, "paths": {}}
    for name, fn in paths.items():
        try:
            err = ((fn().float() - want.float()).abs().max() / want.float().abs().max()).item()
            ms = kernel_ms(fn, iters=10)
        except Exception as exc:  # a tile this Triton cannot compile (shared memory): recorded, not fatal
            row["paths"][name] = {"error": repr(exc)[:300]}
            continue
        row["paths"][name] = {"ms": ms, "of_peak": flops / (ms * 1e-3) / peak, "max_rel_diff": err}
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    device = torch.device("cuda")
    peak = roofline.matmul_peak_flops(device)["flops_per_s"]
    gen = torch.Generator(device=device).manual_seed(0)
    w2 = (torch.randn(E, HID, INTER, generator=gen, device=device) * INTER**-0.5).to(torch.bfloat16)
    res: dict = {"device": torch.cuda.get_device_name(), "matmul_flops_per_s": peak, "runs": []}
    print(f"{res['device']}, bf16 matmul {peak / 1e12:.0f} TFLOP/s\n| tokens | path | ms | of peak | max rel diff |")
    print("|---|---|---|---|---|")
    for t in a.tokens:
        row = workload(t, w2, peak)
        res["runs"].append(row)
        for name, r in row["paths"].items():
            if "ms" in r:
                print(f"| {t} | {name} | {r['ms']:.3f} | {r['of_peak']:.0%} | {r['max_rel_diff']:.2g} |", flush=True)
            else:
                print(f"| {t} | {name} | {r['error']} | | |", flush=True)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
