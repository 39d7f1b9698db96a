"""MoE prefill glue of the fifteenth session, each against the path it replaces, on the GPU.

    python -m bench.moe_prefill_glue --tokens 8192 32768 --out moe_prefill_glue.json

Kimi-Linear's shapes, bf16; GPU kernel time per call (torch.profiler: every kernel of the call, so a path of
several launches counts them all), outputs compared with the replaced path:

- MoE align of T*8 pairs over 256 experts: torch's stable sort path (``moe_align``) against
  ``moe_align_blocks`` (a counting sort in three launches).
- MoE combine with the shared expert's output: the combine, then ``+ shared``, against the combine with ``add``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.gpu_kernels_check import kernel_ms

HIDDEN, EXPERTS, TOP_K = 2304, 256, 8


def align(tokens: int, device: torch.device) -> dict:
    from kernels.moe.align import moe_align_blocks
    from kernels.moe.grouped import moe_align

    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.rand(tokens, EXPERTS, generator=gen, device=device).topk(TOP_K, dim=1).indices
    want, got = moe_align(ids, EXPERTS), moe_align_blocks(ids, EXPERTS)
    same = bool(torch.equal(want.order, got.order) and torch.equal(want.offsets, got.offsets))
    return {
        "tokens": tokens,
        "pairs": ids.numel(),
        "torch_sort_ms": kernel_ms(lambda: moe_align(ids, EXPERTS).rows_of_pairs()),
        "blocks_ms": kernel_ms(lambda: moe_align_blocks(ids, EXPERTS)),
        "same_order": same,
    }


def combine(tokens: int, device: torch.device) -> dict:
    from kernels.moe.combine import moe_combine_triton

    gen = torch.Generator(device=device).manual_seed(2)
    y = torch.randn(tokens * TOP_K, HIDDEN, generator=gen, device=device).to(torch.bfloat16)
    rows = torch.randperm(tokens * TOP_K, generator=gen, device=device)
    weights = torch.rand(tokens, TOP_K, generator=gen, device=device)
    shared = torch.randn(tokens, HIDDEN, generator=gen, device=device).to(torch.bfloat16)
    want = moe_combine_triton(y, rows, weights, torch.bfloat16) + shared
    got = moe_combine_triton(y, rows, weights, torch.bfloat16, shared)
    return {
        "tokens": tokens,
        "combine_then_add_ms": kernel_ms(lambda: moe_combine_triton(y, rows, weights, torch.bfloat16) + shared),
        "combine_with_add_ms": kernel_ms(lambda: moe_combine_triton(y, rows, weights, torch.bfloat16, shared)),
        "bit_identical": bool(torch.equal(want, got)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.moe_prefill_glue", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.moe_prefill_glue needs a CUDA device")
    device = torch.device("cuda")
    res: dict = {"device": torch.cuda.get_device_name(), "rows": []}
    for t in a.tokens:
        row = {"align": align(t, device), "combine": combine(t, device)}
        res["rows"].append(row)
        al, cb = row["align"], row["combine"]
        print(
            f"{t} tokens: align {al['pairs']} pairs {al['torch_sort_ms'] * 1e3:.0f} -> {al['blocks_ms'] * 1e3:.0f} us "
            f"(same order: {al['same_order']}); combine + shared {cb['combine_then_add_ms'] * 1e3:.0f} -> "
            f"{cb['combine_with_add_ms'] * 1e3:.0f} us (bit-identical: {cb['bit_identical']})",
            flush=True,
        )
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
