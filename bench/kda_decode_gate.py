"""fla's fused recurrent KDA kernel (KDA decode) with the gate and beta's sigmoid applied in the kernel or before
it, per batch and launch tile: what ``GPUKDABackend.decode_gate_in_kernel`` trades.

    python -m bench.kda_decode_gate --out kda_decode_gate.json     # on the GPU (~1 min of compiles)

Variants: ``plain`` (fp32 gate from fla's gate kernel, bf16 beta: the kernel as the engine ran it before),
``beta`` (beta's bf16 logits, ``APPLY_BETA_SIGMOID``), ``gate+beta`` (also the raw bf16 gate projection,
``USE_GATE_IN_KERNEL``). The separate launches a variant saves are timed too (fla's gate kernel, torch.sigmoid,
the output's zero fill), so each row's "step" is the kernel plus what still runs beside it. Timing as in
bench/kda_recurrent_sweep.py (CUDA graph replay, L2 flushed, median of --runs).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

from bench.kda_recurrent_sweep import _graphed, _median_ms, _workload
from kernels.kda.recurrent_launch import RecurrentTile, launch_fused_recurrent_kda, tile_for

TILES = ((32, 2, 2), (64, 2, 2), (32, 4, 2), (64, 4, 2), (16, 2, 2))


def run(n: int, heads: int, dim: int, device: torch.device, runs: int) -> list[dict]:
    from fla.ops.kda.gate import fused_kda_gate

    w = _workload(n, heads, dim, device)
    q, k, v, pool, idx = (w[x] for x in ("q", "k", "v", "pool", "idx"))
    gen = torch.Generator(device=device).manual_seed(7)
    g_raw = torch.randn(n, 1, heads, dim, generator=gen, device=device).to(torch.bfloat16)
    logits = torch.randn(n, 1, heads, generator=gen, device=device).to(torch.bfloat16)
    a_log = torch.log(torch.empty(heads, device=device).uniform_(1, 16, generator=gen))
    dt_bias = torch.randn(heads * dim, generator=gen, device=device) * 0.5
    g = fused_kda_gate(g_raw.view(n, heads, dim), a_log, dt_bias, output_dtype=torch.float32).view(n, 1, heads, dim)
    beta = torch.sigmoid(logits)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    out = torch.empty_like(v)
    sides = {
        "gate kernel": lambda: fused_kda_gate(g_raw.view(n, heads, dim), a_log, dt_bias, output_dtype=torch.float32),
        "sigmoid": lambda: torch.sigmoid(logits),
        "zero fill": lambda: torch.zeros_like(v),
    }
    side_ms = {name: _median_ms(_graphed(fn), flush, runs) for name, fn in sides.items()}
    variants = {
        "plain": (dict(g=g, beta=beta), ("gate kernel", "sigmoid", "zero fill")),
        "beta": (dict(g=g, beta=logits, beta_sigmoid=True), ("gate kernel",)),
        "gate+beta": (dict(g=g_raw, beta=logits, gate=(a_log, dt_bias), beta_sigmoid=True), ()),
    }
    rows, ref = [], None
    for name, (kw, extra) in variants.items():
        for bv, warps, stages in TILES:
            tile = RecurrentTile(bv, warps, stages)
            p = pool.clone()
            fn = functools.partial(launch_fused_recurrent_kda, q, k, v, state_pool=p, ssm_state_indices=idx,
                                   num_accepted_tokens=None, cu_seqlens=None, tile=tile, out=out, **kw)  # fmt: skip
            check = pool.clone()
            o = launch_fused_recurrent_kda(q, k, v, state_pool=check, ssm_state_indices=idx, num_accepted_tokens=None,
                                           cu_seqlens=None, tile=tile, **kw).float()  # fmt: skip
            ref = (o, check) if ref is None else ref
            err = max((o - ref[0]).abs().max().item(), (check - ref[1]).abs().max().item())
            ms = _median_ms(_graphed(fn), flush, runs)
            step = ms + sum(side_ms[s] for s in extra)
            rows.append({"batch": n, "variant": name, "bv": bv, "warps": warps, "stages": stages, "kernel_us": ms * 1e3,
                         "step_us": step * 1e3, "max_abs_err_vs_first": err,
                         "engine_tile": tile == tile_for(n)})  # fmt: skip
            print(f"N={n:3d} {name:9s} bv={bv:3d} w={warps} s={stages}: kernel {ms * 1e3:7.2f} us, with its side "
                  f"launches {step * 1e3:7.2f} us, err {err:.1e}{'  (engine tile)' if rows[-1]['engine_tile'] else ''}",
                  flush=True)  # fmt: skip
    print(f"N={n:3d} side launches: " + ", ".join(f"{k} {v * 1e3:.2f} us" for k, v in side_ms.items()), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="*", default=[1, 16, 64])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    rows = [r for n in a.batches for r in run(n, a.heads, a.dim, dev, a.runs)]
    if a.out:
        a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
