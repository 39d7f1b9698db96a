"""Launch-parameter sweep of the slot-indexed short conv (kernels/short_conv/triton.py) on the GPU.

    python -m bench.short_conv_sweep --out short_conv_sweep.json     # about a minute of compiles

Kimi-Linear's KDA layers run one depthwise conv (width 4) + SiLU over q|k|v together: 3 x 32 heads x 128 =
12,288 channels, bf16. For a prefill of T tokens (one sequence, a first chunk) and a decode step of N
sequences, every ``ConvTiles`` of the grid is timed (CUDA events; decode inside a CUDA graph, as the engine
runs it) and checked against the default launch's output. The input is the model's column view of a wider
projection output. Bytes are the input read once and the output written once; the ratio is against the copy
bandwidth measured here. fla-core's ``causal_conv1d`` (same math, no state slots) is timed beside it.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from bench.gpu_kernels_check import timed
from bench.mid import roofline
from kernels.short_conv.triton import ConvTiles, default_tiles, short_conv_update

CHANNELS, WIDTH = 3 * 32 * 128, 4


def _prefill_grid() -> list[ConvTiles]:
    out = []
    for bt, bc, chunk, warps in itertools.product((16, 32, 64), (32, 64, 128, 256), (1, 4, 16), (2, 4, 8)):
        if bt * bc <= 8192 and bt * chunk <= 1024:
            out.append(ConvTiles(bt, bc, bt * chunk, warps))
    return out


def _decode_grid() -> list[ConvTiles]:
    return [ConvTiles(1, bc, 256, w) for bc, w in itertools.product((64, 128, 256, 512, 1024), (1, 2, 4))]


def _graph_timed(fn, iters: int = 20) -> float:
    """Milliseconds per call with `iters` calls captured in one CUDA graph (no host launch cost)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    return timed(g.replay, iters=5) / iters


def sweep(kind: str, tokens: int, device: torch.device, copy_bw: float) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    n = 1 if kind == "prefill" else tokens
    wide = torch.randn(tokens, CHANNELS + 4096, generator=gen, device=device).to(torch.bfloat16)
    x = wide[:, :CHANNELS]  # the q|k|v columns of the fused projection's output
    weight = torch.randn(CHANNELS, WIDTH, generator=gen, device=device).to(torch.bfloat16)
    state = torch.randn(n + 1, CHANNELS, WIDTH - 1, generator=gen, device=device).to(torch.bfloat16)
    slots = torch.arange(1, n + 1, dtype=torch.int32, device=device)
    qsl = torch.linspace(0, tokens, n + 1, device=device).round().to(torch.int32)
    init = torch.full((n,), int(kind == "decode"), dtype=torch.int32, device=device)
    seq = tokens // n
    out = torch.empty(tokens, CHANNELS, dtype=torch.bfloat16, device=device)

    def run(tiles: ConvTiles | None):
        st = state.clone()  # each config starts from the same windows
        return lambda: short_conv_update(x, weight, st, slots, qsl, init, out=out, max_q_len=seq, tiles=tiles)

    base = default_tiles(seq, CHANNELS)
    run(base)()
    ref = out.clone()
    nbytes = 2 * tokens * CHANNELS * 2
    time = _graph_timed if kind == "decode" else (lambda f: timed(f, iters=20))
    rows = []
    for tiles in [base] + (_prefill_grid() if kind == "prefill" else _decode_grid()):
        cfg = {"block_t": tiles.block_t, "block_c": tiles.block_c, "t_chunk": tiles.t_chunk, "warps": tiles.num_warps}
        try:
            fn = run(tiles)
            fn()
            err = (out.float() - ref.float()).abs().max().item()
            ms = time(fn)
        except Exception as e:  # out of registers / shared memory for this tile
            rows.append({**cfg, "error": repr(e)[:200]})
            continue
        rows.append({**cfg, "ms": ms, "roofline": nbytes / ms * 1e3 / copy_bw, "max_abs_err_vs_default": err})
    ok = [r for r in rows if "ms" in r]
    res = {"kind": kind, "tokens": tokens, "bytes": nbytes, "default": ok[0], "best": min(ok, key=lambda r: r["ms"])}
    if kind == "prefill":
        res["fla_causal_conv1d"] = _fla(x, weight, nbytes, copy_bw)
    res["rows"] = rows
    return res


def _fla(x: torch.Tensor, weight: torch.Tensor, nbytes: int, copy_bw: float) -> dict:
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception as e:  # fla-core missing
        return {"error": repr(e)[:200]}
    xb = x[None]

    def fn():
        return causal_conv1d(xb, weight, activation="silu")

    fn()
    ms = timed(fn, iters=20)
    return {"ms": ms, "roofline": nbytes / ms * 1e3 / copy_bw}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", nargs="*", type=int, default=[8192, 32768])
    p.add_argument("--decode", nargs="*", type=int, default=[64])
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    device = torch.device("cuda")
    copy_bw = roofline.copy_bandwidth(device)["bytes_per_s"]
    res = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": copy_bw, "workloads": []}
    for kind, tokens in [("prefill", t) for t in a.prefill] + [("decode", t) for t in a.decode]:
        r = sweep(kind, tokens, device, copy_bw)
        res["workloads"].append(r)
        d, b = r["default"], r["best"]
        line = f"== {kind} {tokens}: default {d['ms'] * 1e3:.1f} us ({d['roofline']:.0%}), best {b['ms'] * 1e3:.1f} us"
        line += f" ({b['roofline']:.0%}) {b}"
        if "fla_causal_conv1d" in r and "ms" in r["fla_causal_conv1d"]:
            f = r["fla_causal_conv1d"]
            line += f"; fla causal_conv1d {f['ms'] * 1e3:.1f} us ({f['roofline']:.0%})"
        print(line, flush=True)
        top = sorted((x for x in r["rows"] if "ms" in x), key=lambda x: x["ms"])[:5]
        for x in top:
            print(f"   {x}", flush=True)
        if a.out:
            a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
