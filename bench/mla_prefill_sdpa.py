"""MLA prefill attention with no prefix: our Triton kernel (the expanded form) against torch SDPA's backends.

    python -m bench.mla_prefill_sdpa --out mla_prefill_sdpa.json      # on the GPU (about a minute)

Kimi-Linear's MLA heads: 32 x (128 nope + 64 rope) queries and keys (k_pe shared by the heads), values 128,
bf16, one causal sequence of T tokens. Rows: the Triton kernel as ``mla_expanded`` launches it (k_pe with a
head stride of 0); SDPA's cuDNN backend (the engine's path for such sequences, kernels/paged_attention/
sdpa_prefill.py) with and without building the whole keys (``torch.cat``, which the engine pays); SDPA's flash
backend (values zero-padded to 192: it needs one head size) and its memory-efficient backend. FLOP/s count the
causal half of QK^T and PV; the ceiling is the bf16 matmul rate measured in the same run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.gpu_kernels_check import timed
from bench.mid import roofline
from kernels.paged_attention.meta import build_attn_meta
from kernels.paged_attention.sdpa_prefill import causal_self_attention
from kernels.paged_attention.triton import attention_fwd

HEADS, NOPE, ROPE, V = 32, 128, 64, 128


def run(t: int, device: torch.device, peak: float) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(t, HEADS, NOPE + ROPE, generator=g, device=device).bfloat16()
    kv = torch.randn(t, HEADS, NOPE + V, generator=g, device=device).bfloat16()
    k_pe = torch.randn(t, 1, ROPE, generator=g, device=device).bfloat16().expand(t, HEADS, ROPE)
    scale = (NOPE + ROPE) ** -0.5
    meta = build_attn_meta([t], [t], 1, 64, device, kv_start=[0])
    k_whole = torch.cat([kv[..., :NOPE], k_pe], -1)
    v = kv[..., NOPE:]

    def sdpa(backend: SDPBackend, pad_v: bool):
        def f():
            with sdpa_kernel(backend):
                vv = F.pad(v, (0, NOPE + ROPE - V)) if pad_v else v
                o = F.scaled_dot_product_attention(
                    q.transpose(0, 1)[None],
                    k_whole.transpose(0, 1)[None],
                    vv.transpose(0, 1)[None],
                    is_causal=True,
                    scale=scale,
                )
            return o[0].transpose(0, 1)[..., :V]

        return f

    paths = {
        "triton (expanded form)": lambda: attention_fwd(
            q[..., :NOPE], kv[..., :NOPE], v, meta, scale, q_b=q[..., NOPE:], k_b=k_pe
        ),
        "sdpa cudnn, keys built (engine path)": lambda: causal_self_attention(
            q, torch.cat([kv[..., :NOPE], k_pe], -1), v, [t], scale
        ),
        "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION, False),
        "sdpa flash, values padded": sdpa(SDPBackend.FLASH_ATTENTION, True),
        "sdpa memory-efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION, False),
    }
    flops = 2 * HEADS * t * t / 2 * (NOPE + ROPE + V)
    ref = paths["triton (expanded form)"]().float()
    row: dict = {"tokens": t, "flops": flops, "paths": {}}
    for name, fn in paths.items():
        try:
            err = (fn().float() - ref).abs().max().item()
            ms = timed(fn, iters=10)
        except RuntimeError as e:  # a backend without a kernel for these shapes
            row["paths"][name] = {"error": repr(e)[:200]}
            continue
        row["paths"][name] = {
            "ms": ms,
            "tflops": flops / ms / 1e9,
            "of_peak": flops / ms * 1e3 / peak,
            "max_abs_diff_vs_triton": err,
        }
    base = row["paths"]["triton (expanded form)"]["ms"]
    for r in row["paths"].values():
        if "ms" in r:
            r["speedup_vs_triton"] = base / r["ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    device = torch.device("cuda")
    peak = roofline.matmul_peak_flops(device)["flops_per_s"]
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    res |= {"matmul_flops_per_s": peak, "runs": []}
    print(f"{res['device']}, torch {res['torch']}, cuDNN {res['cudnn']}, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    print("| tokens | path | ms | TFLOP/s | of matmul peak | vs Triton | max abs diff vs Triton |\n" + "|---" * 7 + "|")
    for t in a.tokens:
        row = run(t, device, peak)
        res["runs"].append(row)
        for name, r in row["paths"].items():
            if "ms" not in r:
                print(f"| {t} | {name} | {r['error']} | | | | |")
                continue
            print(
                f"| {t} | {name} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['of_peak']:.0%} | "
                f"{r['speedup_vs_triton']:.2f}x | {r['max_abs_diff_vs_triton']:.2g} |",
                flush=True,
            )
        if a.out:
            a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
