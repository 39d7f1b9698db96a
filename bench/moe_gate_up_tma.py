"""The MoE gate-up GEMM with the expert weights through TMA (kernels/moe/prefill_tma.py) against the pointer
kernel the engine runs (kernels/moe/prefill.gate_up_fused), on the GPU.

    python -m bench.moe_gate_up_tma --tokens 8192 32768 --out moe_gate_up_tma.json

Kimi-Linear's expert shapes (256 experts, top-8, hidden 2304, expert size 1024), bf16, random routing as in
``bench/moe_prefill_sweep.py``; GPU kernel time of the GEMM (the tile map built once, outside), useful FLOPs
against the bf16 matmul peak measured in the run, the output's largest difference relative to the pointer
kernel's. Tiles: the engine's (128 x 128 x 64, 8 warps) at 3 and 4 stages.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from bench import moe_paths
from bench.moe_paths import time_paths
from bench.moe_prefill_sweep import HID, INTER, E, K
from kernels.moe.grouped import moe_align
from kernels.moe.prefill import GATE_UP_TILES, gate_up_fused
from kernels.moe.prefill_tma import gate_up_tma
from kernels.moe.tiles import tiles_of
from kernels.moe.triton import sigmoid_topk_route_triton


def workload(t: int, w13: torch.Tensor, peak: float) -> dict:
    device = w13.device
    gen = torch.Generator(device=device).manual_seed(t)
    x = torch.randn(t, HID, generator=gen, device=device).to(torch.bfloat16)
    _, ids = sigmoid_topk_route_triton(torch.randn(t, E, generator=gen, device=device), None, K, True, 1.0)
    al = moe_align(ids, E)
    tmap = tiles_of(al, al.token.numel(), GATE_UP_TILES.block_m, None)
    flops = 2.0 * al.token.numel() * HID * 2 * INTER
    want = gate_up_fused(x, al, w13, GATE_UP_TILES, tmap)
    paths = {"pointer (engine)": lambda: gate_up_fused(x, al, w13, GATE_UP_TILES, tmap)}
    for stages in (3, 4):
        tiles = replace(GATE_UP_TILES, num_stages=stages)
        paths[f"tma {stages} stages"] = lambda tiles=tiles: gate_up_tma(x, al, w13, tiles, tmap)
    return {"tokens": t, "pairs": al.token.numel(), "paths": time_paths(paths, want, flops, peak)}


def _weight(device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(0)
    return (torch.randn(E, 2 * INTER, HID, generator=gen, device=device) * HID**-0.5).to(torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    return moe_paths.main(__doc__, _weight, workload, argv)


if __name__ == "__main__":
    raise SystemExit(main())
