"""Launch-parameter sweep of MLA's latent (weight-absorbed) decode: the general paged-attention kernel and the
all-heads kernel (kernels/paged_attention/mla_decode.py).

    python -m bench.mla_decode_sweep --out mla_sweep.json      # on the GPU (a few minutes of compiles)

Kimi-Linear's MLA: 32 heads share one latent "KV head" of kv_lora_rank 512 + rope 64 (bf16, page 16). For
each workload (batch x context) every configuration of both kernels is timed with CUDA events and checked
against the baseline's output (the general kernel's launch before the sweep, reported as "default"):
``"kernel": "general"`` rows sweep (rows per program, key tile, warps, pipeline stages, key splits),
``"kernel": "all_heads"`` rows (one program covers all 32 heads, so each latent tile is read once) sweep
(keys-major / heads-major, key tile, warps, stages, key splits). Bytes are the latent rows the step must read
once; the ratio is against the device copy bandwidth measured here.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from pathlib import Path

import torch

from bench.gpu_kernels_check import timed
from bench.mid import roofline
from kernels.paged_attention.meta import build_attn_meta
from kernels.paged_attention.mla_decode import mla_decode_fwd, mla_decode_splits
from kernels.paged_attention.triton import attention_fwd, choose_splits

HEADS, RANK, ROPE, PAGE = 32, 512, 64, 16
KERNELS = ("general", "all_heads")


def _workload(batch: int, ctx: int, device: torch.device, gen: torch.Generator):
    pages_per_seq = -(-ctx // PAGE)
    num_pages = batch * pages_per_seq + 1
    latent = torch.randn(num_pages, PAGE, 1, RANK + ROPE, generator=gen, device=device).to(torch.bfloat16)
    perm = torch.randperm(num_pages - 1, generator=gen, device=device)[: batch * pages_per_seq] + 1
    tables = perm.view(batch, pages_per_seq).to(torch.int32)
    q_lat = torch.randn(batch, HEADS, RANK, generator=gen, device=device).to(torch.bfloat16)
    q_pe = torch.randn(batch, HEADS, ROPE, generator=gen, device=device).to(torch.bfloat16)
    return latent, tables, q_lat, q_pe


def sweep(
    batch: int, ctx: int, device: torch.device, copy_bw: float, general: str = "sweep", block_hs: tuple = (32,)
) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    latent, tables, q_lat, q_pe = _workload(batch, ctx, device, gen)
    scale = (128 + 64) ** -0.5
    kv, k_pe = latent[..., :RANK], latent[..., RANK:]

    def run(block_m: int, block_n: int | None, warps: int | None, stages: int, splits: int | None):
        meta = build_attn_meta([1] * batch, [ctx] * batch, HEADS, block_m, device, block_tables=tables)
        return lambda: attention_fwd(
            q_lat,
            kv,
            None,
            meta,
            scale,
            q_b=q_pe,
            k_b=k_pe,
            num_splits=splits,
            block_n=block_n,
            num_warps=warps,
            num_stages=stages,
        )

    # the baseline: the launch before this sweep (16-key tiles, 8 warps, ~2 programs per SM)
    base_meta = build_attn_meta([1] * batch, [ctx] * batch, HEADS, 16, device, block_tables=tables)
    auto_splits = choose_splits(base_meta, 1, 16, device, waves=2)
    ref = run(16, 16, 8, 2, auto_splits)()
    bytes_read = batch * ctx * (RANK + ROPE) * 2
    max_splits = max(1, ctx // 128)
    rows = []

    def measure(cfg: dict, make) -> None:
        try:
            fn = make()
            out = fn()
            err = (out.float() - ref.float()).abs().max().item()
            ms = timed(fn, iters=30)
        except Exception as e:  # out of shared memory / registers for this tile
            rows.append({**cfg, "error": repr(e)[:200]})
            return
        rows.append(
            {
                **cfg,
                "ms": ms,
                "bytes_per_s": bytes_read / ms * 1e3,
                "roofline": bytes_read / ms * 1e3 / copy_bw,
                "max_abs_err_vs_default": err,
            }
        )
        print(f"b={batch} ctx={ctx} {rows[-1]}", flush=True)

    if general == "current":  # the general kernel as the engine launches it today, defaults only
        meta = build_attn_meta([1] * batch, [ctx] * batch, HEADS, 16, device, block_tables=tables)
        measure(
            {"kernel": "general", "block_m": 16, "block_n": None, "warps": None, "stages": 2, "splits": None},
            lambda: lambda: attention_fwd(q_lat, kv, None, meta, scale, q_b=q_pe, k_b=k_pe),
        )
    grid = itertools.product((16, 32), (16, 32, 64), (4, 8), (2, 3), (1, 2, 4)) if general == "sweep" else ()
    for block_m, block_n, warps, stages, split_mult in grid:
        if block_m * block_n > 2048 or (block_m == 32 and warps == 4):
            continue  # register spills: a [32, 512] fp32 accumulator wants 8 warps
        splits = max(1, auto_splits * split_mult * (16 // block_m))
        splits = min(splits, max_splits)
        cfg = {"kernel": "general", "block_m": block_m, "block_n": block_n, "warps": warps, "stages": stages}
        measure({**cfg, "splits": splits}, functools.partial(run, block_m, block_n, warps, stages, splits))

    # the all-heads kernel: one program per (sequence, split) for all 32 heads
    ctx_t = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    ah_auto = mla_decode_splits(batch, ctx, device)
    measure(  # as the engine launches it: the kernel's own defaults
        {"kernel": "all_heads", "default": True},
        lambda: lambda: mla_decode_fwd(q_lat, q_pe, latent[:, :, 0], tables, ctx_t, ctx, scale),
    )
    seen = set()
    for block_h, keys_major, block_n, warps, stages, split_mult in itertools.product(
        block_hs, (False, True), (16, 32, 64), (4, 8, 16), (1, 2, 3), (1, 2, 4)
    ):
        if keys_major and (block_n == 16 or stages == 1):
            # 16 rows: too small an M for tensor cores; 1 stage: refused by mla_decode_fwd (miscompiled)
            continue
        if warps == 4 and block_n == 64:
            continue  # a [32, 512] fp32 accumulator is 128 registers a thread at 4 warps, plus 64-key tiles
        if warps == 16 and (keys_major or block_h > HEADS):
            continue  # 16 warps: for the heads-major [32, 512] accumulator (32 registers a thread of it; ptxas for
            # sm_90: 102 registers at 32-key tiles where 4 warps take 255 and spill: bench/sm90_report.py's method)
        if block_h > HEADS and (warps == 4 or keys_major):
            continue  # padded heads: a [64, 512] accumulator needs both warpgroups; keys-major has no M to pad
        splits = min(max(1, ah_auto * split_mult), max_splits)
        key = (block_h, keys_major, block_n, warps, stages, splits)
        if key in seen:  # several multipliers capped to the same split count
            continue
        seen.add(key)
        cfg = {"kernel": "all_heads", "block_h": block_h, "keys_major": keys_major, "block_n": block_n}
        cfg |= {"warps": warps, "stages": stages, "splits": splits}

        def make(keys_major=keys_major, block_n=block_n, warps=warps, stages=stages, splits=splits, block_h=block_h):
            out = torch.empty_like(q_lat)
            return lambda: mla_decode_fwd(
                q_lat,
                q_pe,
                latent[:, :, 0],
                tables,
                ctx_t,
                ctx,
                scale,
                num_splits=splits,
                block_n=block_n,
                num_warps=warps,
                num_stages=stages,
                keys_major=keys_major,
                out=out,
                block_h=block_h,
            )

        measure(cfg, make)

    ok = [r for r in rows if "ms" in r]
    want_splits = max(1, min(auto_splits, max_splits))
    defaults = [
        r
        for r in ok
        if r["kernel"] == "general"
        and (r["block_m"], r["block_n"], r["warps"], r["stages"], r["splits"]) == (16, 16, 8, 2, want_splits)
    ]
    default = defaults[0] if defaults else ok[0]
    ah_defaults = [r for r in ok if r.get("default")]
    best = {k: min((r for r in ok if r["kernel"] == k), key=lambda r: r["ms"], default=None) for k in KERNELS}
    return {
        "batch": batch,
        "ctx": ctx,
        "bytes": bytes_read,
        "default": default,
        "all_heads_default": ah_defaults[0] if ah_defaults else None,
        "best": min(ok, key=lambda r: r["ms"]),
        "best_per_kernel": best,
        "rows": rows,
    }


def _fmt(r: dict | None) -> str:
    if r is None:
        return "none ran"
    cfg = {k: v for k, v in r.items() if k not in ("ms", "bytes_per_s", "roofline", "kernel")}
    return f"{r['ms']:.3f} ms ({r['roofline']:.0%}) {cfg}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="*", default=["64x4096", "16x32768", "1x32768", "64x32768"])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--general", choices=("sweep", "current"), default="sweep", help="the general kernel's grid, or its defaults"
    )
    p.add_argument(
        "--block-h", type=int, nargs="*", default=[32], help="all-heads kernel: heads tile rows (64 pads 32 heads)"
    )
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device("cuda")
    copy_bw = roofline.copy_bandwidth(device)["bytes_per_s"]
    res = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": copy_bw, "workloads": []}
    for w in a.workloads:
        b, c = (int(x) for x in w.split("x"))
        r = sweep(b, c, device, copy_bw, a.general, tuple(a.block_h))
        res["workloads"].append(r)
        best = r["best_per_kernel"]
        print(
            f"== {w}: default {_fmt(r['default'])}; best general {_fmt(best['general'])}; "
            f"all_heads default {_fmt(r['all_heads_default'])}; best all_heads {_fmt(best['all_heads'])}",
            flush=True,
        )
        if a.out:
            a.out.write_text(json.dumps(res, indent=1))
    res["total_wall_s"] = time.perf_counter() - t0
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    print(f"== total wall time {res['total_wall_s']:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
