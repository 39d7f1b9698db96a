"""The skinny GEMM (kernels/gemv) against cuBLAS (``F.linear``) at the Kimi mid model's dense projections, over the
launch tiles it could take: the sweep behind ``kernels.gemv.triton.gemv_tile``.

    python -m bench.gemv_sweep --out gemv_sweep.json      # GPU, ~2 min (Triton compiles each tile once)

Each (rows, N, K) runs as a CUDA graph of launches over enough copies of the weight that they do not fit in L2
(as in a decode step, where every weight is read once), the median of several replays; achieved bytes/s (weight +
x + y) against the same run's copy bandwidth. Every tile's output is checked against ``naive_gemv``.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.graph_time import graph_us
from bench.mid.roofline import copy_bandwidth
from kernels.gemv.naive import naive_gemv
from kernels.gemv.triton import GemvTile, gemv, gemv_tile

SHAPES = {  # (N, K): the mid model's dense projections of a decode step
    "kda in_proj (q|k|v|f_a|g_a|b)": (12576, 2304),
    "o_proj (KDA, MLA)": (2304, 4096),
    "mla q|kv_a": (6720, 2304),
    "dense mlp gate|up": (18432, 2304),
    "dense mlp down": (2304, 9216),
}
ROTATE_BYTES = 256 << 20  # > 4x the H200's 50 MB L2
LAUNCHES = 16


def one_row_tiles() -> list[GemvTile]:
    tiles = [GemvTile(n, k, w, 3) for n, k, w in itertools.product((8, 16, 32), (256, 512, 1024), (4, 8))]
    return tiles + [GemvTile(16, 512, 4, s) for s in (2, 5)]


def dot_tiles() -> list[GemvTile]:
    return [GemvTile(n, k, 4, s) for n, k, s in itertools.product((16, 32, 64), (64, 128, 256), (3, 5))]


def rotated_us(fn: Callable[[int], object], copies: int) -> float:
    """Microseconds per call of fn(i) over the weight copies i in turn (``graph_us`` of one round of them)."""
    return graph_us(lambda: [fn(i) for i in range(copies)], iters=max(1, LAUNCHES // copies)) / copies


def sweep_shape(name: str, n: int, k: int, m: int, bw: float, dev: torch.device) -> dict:
    wbytes = n * k * 2
    copies = max(2, -(-ROTATE_BYTES // wbytes))
    gen = torch.Generator(device=dev).manual_seed(n + k + m)
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) / k**0.5 for _ in range(copies)]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
    outs = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
    moved = wbytes + 2 * m * (n + k)
    ref = naive_gemv(x, ws[0]).float()

    def frac(us: float) -> float:
        return moved / (us * 1e-6) / bw

    cublas = rotated_us(lambda i: torch.mm(x, ws[i].t(), out=outs[i]), copies)
    assert F.linear(x, ws[0]).shape == (m, n)
    tiles = one_row_tiles() if m == 1 else dot_tiles()
    if gemv_tile(m, n, k) not in tiles:
        tiles.append(gemv_tile(m, n, k))
    rows = []
    for tile in tiles:
        got = gemv(x, ws[0], tile=tile).float()
        err = ((got - ref).norm() / ref.norm()).item()
        us = rotated_us(lambda i, t=tile: gemv(x, ws[i], out=outs[i], tile=t), copies)
        rows.append({"tile": tile.__dict__, "us": us, "roofline": frac(us), "rel_err": err})
    best = min(rows, key=lambda r: r["us"])
    default = gemv_tile(m, n, k).__dict__
    dflt = next((r for r in rows if r["tile"] == default), None)
    return {
        "name": name,
        "m": m,
        "n": n,
        "k": k,
        "weight_mb": wbytes / 1e6,
        "cublas_us": cublas,
        "cublas_roofline": frac(cublas),
        "best": best,
        "default": dflt,
        "max_rel_err": max(r["rel_err"] for r in rows),
        "tiles": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gemv_sweep", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.gemv_sweep times CUDA kernels: it needs a GPU")
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)["bytes_per_s"]
    print(f"{torch.cuda.get_device_name(dev)}: copy {bw / 1e12:.2f} TB/s")
    results = []
    for m in a.rows:
        for name, (n, k) in SHAPES.items():
            r = sweep_shape(name, n, k, m, bw, dev)
            results.append(r)
            b, d = r["best"], r["default"]
            print(
                f"m={m:2d} {name:32s} {r['weight_mb']:5.1f} MB  cuBLAS {r['cublas_us']:6.2f} us "
                f"({r['cublas_roofline']:.0%})  best {b['us']:6.2f} us ({b['roofline']:.0%}) {b['tile']}  "
                f"default {d['us'] if d else float('nan'):6.2f} us  max rel err {r['max_rel_err']:.1e}"
            )
    if a.out:
        a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "copy_bps": bw, "rows": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
