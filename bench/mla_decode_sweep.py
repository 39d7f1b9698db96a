"""Launch-parameter sweep of the paged-attention kernel in MLA's latent (weight-absorbed) decode form.

    python -m bench.mla_decode_sweep --out mla_sweep.json      # on the GPU (about a minute of compiles)

Kimi-Linear's MLA: 32 heads share one latent "KV head" of kv_lora_rank 512 + rope 64 (bf16, page 16). For
each workload (batch x context) every (rows per program, key tile, warps, pipeline stages, key splits)
configuration is timed with CUDA events and checked against the baseline's output (the launch before
the sweep, reported as "default"). Bytes are the latent rows the step must read once; the ratio is against
the device copy bandwidth measured here.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from bench.gpu_kernels_check import timed
from bench.mid import roofline
from kernels.paged_attention.meta import build_attn_meta
from kernels.paged_attention.triton import attention_fwd, choose_splits

HEADS, RANK, ROPE, PAGE = 32, 512, 64, 16


def _workload(batch: int, ctx: int, device: torch.device, gen: torch.Generator):
    pages_per_seq = -(-ctx // PAGE)
    num_pages = batch * pages_per_seq + 1
    latent = torch.randn(num_pages, PAGE, 1, RANK + ROPE, generator=gen, device=device).to(torch.bfloat16)
    perm = torch.randperm(num_pages - 1, generator=gen, device=device)[: batch * pages_per_seq] + 1
    tables = perm.view(batch, pages_per_seq).to(torch.int32)
    q_lat = torch.randn(batch, HEADS, RANK, generator=gen, device=device).to(torch.bfloat16)
    q_pe = torch.randn(batch, HEADS, ROPE, generator=gen, device=device).to(torch.bfloat16)
    return latent, tables, q_lat, q_pe


def sweep(batch: int, ctx: int, device: torch.device, copy_bw: float) -> dict:
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
    rows = []
    for block_m, block_n, warps, stages, split_mult in itertools.product(
        (16, 32), (16, 32, 64), (4, 8), (2, 3), (1, 2, 4)
    ):
        if block_m * block_n > 2048 or (block_m == 32 and warps == 4):
            continue  # register spills: a [32, 512] fp32 accumulator wants 8 warps
        splits = max(1, auto_splits * split_mult * (16 // block_m))
        splits = min(splits, max(1, ctx // 128))
        cfg = {"block_m": block_m, "block_n": block_n, "warps": warps, "stages": stages, "splits": splits}
        try:
            fn = run(block_m, block_n, warps, stages, splits)
            out = fn()
            err = (out.float() - ref.float()).abs().max().item()
            ms = timed(fn, iters=30)
        except Exception as e:  # out of shared memory / registers for this tile
            rows.append({**cfg, "error": repr(e)[:200]})
            continue
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
    ok = [r for r in rows if "ms" in r]
    want_splits = max(1, min(auto_splits, max(1, ctx // 128)))
    defaults = [
        r
        for r in ok
        if (r["block_m"], r["block_n"], r["warps"], r["stages"], r["splits"]) == (16, 16, 8, 2, want_splits)
    ]
    default = defaults[0] if defaults else ok[0]
    best = min(ok, key=lambda r: r["ms"])
    return {"batch": batch, "ctx": ctx, "bytes": bytes_read, "default": default, "best": best, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="*", default=["64x4096", "16x32768", "1x32768", "64x32768"])
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    device = torch.device("cuda")
    copy_bw = roofline.copy_bandwidth(device)["bytes_per_s"]
    res = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": copy_bw, "workloads": []}
    for w in a.workloads:
        b, c = (int(x) for x in w.split("x"))
        r = sweep(b, c, device, copy_bw)
        res["workloads"].append(r)
        d, best = r["default"], r["best"]
        print(
            f"== {w}: default {d['ms']:.3f} ms ({d['roofline']:.0%}), best {best['ms']:.3f} ms "
            f"({best['roofline']:.0%}) {best}",
            flush=True,
        )
        if a.out:
            a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
