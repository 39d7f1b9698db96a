"""MLA prefill keys for SDPA (no prefix): concatenated after the kv_b GEMM against one stacked GEMM, on the GPU;
and the MoE tile map as one program against one launch of slot blocks (the sixteenth session's two glue cuts).

    python -m bench.mla_sdpa_keys --tokens 8192 32768 --out mla_sdpa_keys.json

Kimi-Linear's MLA (32 heads, kv_lora_rank 512, nope 128, rope 64, v 128), bf16, one causal sequence of T tokens.
GPU kernel time per call (torch.profiler: every kernel of the path), outputs compared between the two paths:

- keys: ``linear(c_kv, kv_b)`` then ``cat(k_nope, k_pe broadcast)`` (the path before) against
  ``sdpa_prefill.mla_keys_values`` (k_nope | k_pe | v out of one GEMM with identity rows for k_pe); and the whole
  attention (keys + cuDNN SDPA) each way.
- tile map of T*8 pairs over 256 experts in 128-row tiles (the gate-up GEMM's): ``tile_map`` as it launches now.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.gpu_kernels_check import kernel_ms

HEADS, RANK, NOPE, ROPE, V = 32, 512, 128, 64, 128
EXPERTS, TOP_K = 256, 8


def keys(t: int, device: torch.device) -> dict:
    from kernels.paged_attention.mla import _expand_latent
    from kernels.paged_attention.sdpa_prefill import causal_self_attention, mla_keys_values

    g = torch.Generator(device=device).manual_seed(0)
    latent = torch.randn(t, RANK + ROPE, generator=g, device=device).bfloat16()
    kv_b = (torch.randn(HEADS * (NOPE + V), RANK, generator=g, device=device) * RANK**-0.5).bfloat16()
    q = torch.randn(t, HEADS, NOPE + ROPE, generator=g, device=device).bfloat16()
    scale = (NOPE + ROPE) ** -0.5

    def cat_keys():
        kv, k_pe = _expand_latent(latent, kv_b, HEADS, RANK, NOPE + V)
        return torch.cat([kv[..., :NOPE], k_pe], dim=-1), kv[..., NOPE:]

    def stacked_keys():
        return mla_keys_values(latent, kv_b, HEADS, RANK, NOPE, V)

    (k0, v0), (k1, v1) = cat_keys(), stacked_keys()
    o0 = causal_self_attention(q, k0, v0, [t], scale)
    o1 = causal_self_attention(q, k1, v1, [t], scale)
    return {
        "tokens": t,
        "keys_cat_ms": kernel_ms(cat_keys),
        "keys_stacked_ms": kernel_ms(stacked_keys),
        "attention_cat_ms": kernel_ms(lambda: causal_self_attention(q, *cat_keys(), [t], scale)),
        "attention_stacked_ms": kernel_ms(lambda: causal_self_attention(q, *stacked_keys(), [t], scale)),
        "k_pe_equal": bool(torch.equal(k0[..., NOPE:], k1[..., NOPE:])),
        "k_nope_max_abs_diff": (k0[..., :NOPE].float() - k1[..., :NOPE].float()).abs().max().item(),
        "out_max_abs_diff": (o0.float() - o1.float()).abs().max().item(),
    }


def tiles(t: int, device: torch.device) -> dict:
    from kernels.moe.grouped import moe_align
    from kernels.moe.prefill import tile_map

    g = torch.Generator(device=device).manual_seed(1)
    ids = torch.rand(t, EXPERTS, generator=g, device=device).topk(TOP_K, dim=1).indices
    ends = moe_align(ids, EXPERTS).offsets.to(torch.int32)
    return {"tokens": t, "tile_map_ms": kernel_ms(lambda: tile_map(ends, ids.numel(), 128))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    device = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(), "keys": [], "tile_map": []}
    for t in a.tokens:
        k, m = keys(t, device), tiles(t, device)
        res["keys"].append(k)
        res["tile_map"].append(m)
        print(
            f"{t} tokens: keys cat {k['keys_cat_ms']:.3f} ms -> stacked {k['keys_stacked_ms']:.3f} ms; "
            f"keys + attention {k['attention_cat_ms']:.3f} -> {k['attention_stacked_ms']:.3f} ms; k_pe equal "
            f"{k['k_pe_equal']}, k_nope max diff {k['k_nope_max_abs_diff']:.3g}, out max diff "
            f"{k['out_max_abs_diff']:.3g}; tile map {m['tile_map_ms'] * 1e3:.1f} us",
            flush=True,
        )
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
