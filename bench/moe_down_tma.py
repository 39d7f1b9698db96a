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

import torch

from bench import moe_paths
from bench.moe_paths import time_paths
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
    return {"tokens": t, "pairs": n, "paths": time_paths(paths, want, flops, peak)}


def _weight(device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(0)
    return (torch.randn(E, HID, INTER, generator=gen, device=device) * INTER**-0.5).to(torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    return moe_paths.main(__doc__, _weight, workload, argv)


if __name__ == "__main__":
    raise SystemExit(main())
