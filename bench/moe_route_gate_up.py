"""The one-token MoE routing inside the gate-up launch (kernels/moe/route_gate_up.py) against the two launches it
replaces (``router_route``, then the pair-row gate-up), alone, at Kimi-Linear's shapes (hidden 2304, 256 experts
top-8 + the shared one, 1024 wide), random bf16 weights.

    python -m bench.moe_route_gate_up [--tokens 16] [--out route_gate_up.json]      # GPU, ~1 min

The fused launch twice: its routed programs told their experts by the flag (the default) and by the slot words
(``slot_words=True``, ``TANDEM_MOE_ROUTE_SLOT_WORDS=1``).

Each launch gets the next of ``--tokens`` different tokens, so each routes to other experts and their weights come
from HBM (the shared expert's and the router's stay in L2 from call to call, in both forms alike). Times are
CUDA-graph replays (``bench.graph_time``). Every token's fused output is checked bit for bit against the two
launches first."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.graph_time import graph_us
from bench.mid.roofline import copy_bandwidth
from kernels.moe import route_gate_up as fused_module

HID, E, INTER, TOP_K = 2304, 256, 1024, 8


def two_launches(x, w, ticket, bias, w13):
    return fused_module.route_then_gate_up(x, w, ticket, bias, TOP_K, True, 2.446, w13, extra_expert=E)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.moe_route_gate_up", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--device", default="cuda", help="cuda (cpu: the code path under TRITON_INTERPRET=1, in tests)")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    xs = [torch.randn(1, HID, generator=gen, device=dev).to(torch.bfloat16) for _ in range(a.tokens)]
    w = (torch.randn(E, HID, generator=gen, device=dev) / HID**0.5).to(torch.bfloat16)
    bias = 0.1 * torch.randn(E, generator=gen, device=dev)
    w13 = (torch.randn(E + 1, 2 * INTER, HID, generator=gen, device=dev) / HID**0.5).to(torch.bfloat16)
    sync = torch.zeros(fused_module.SYNC_SIZE, dtype=torch.int32, device=dev)
    ticket = torch.zeros(1, dtype=torch.int32, device=dev)

    def fused(x: torch.Tensor, slot_words: bool) -> tuple[torch.Tensor, ...]:
        return fused_module.route_gate_up(
            x, w, sync, bias, TOP_K, True, 2.446, w13, extra_expert=E, slot_words=slot_words
        )

    for x in xs:
        want = two_launches(x, w, ticket, bias, w13)
        for slot_words in (False, True):
            if not all(torch.equal(g, t) for g, t in zip(fused(x, slot_words), want, strict=True)):
                raise SystemExit(f"the fused launch (slot_words={slot_words}) differs from the two launches")
    turn = [0]

    def next_x() -> torch.Tensor:
        turn[0] += 1
        return xs[turn[0] % len(xs)]

    res = {
        "fused_flag_us": graph_us(lambda: fused(next_x(), False), a.tokens),
        "fused_slot_words_us": graph_us(lambda: fused(next_x(), True), a.tokens),
        "two_launches_us": graph_us(lambda: two_launches(next_x(), w, ticket, bias, w13), a.tokens),
        "copy_tb_s": copy_bandwidth(dev)["bytes_per_s"] / 1e12,
    }
    if sync.any() or ticket.any():
        raise SystemExit(f"counters not back at 0: {sync.tolist()} {ticket.tolist()}")
    nbytes = (TOP_K + 1) * 2 * INTER * HID * 2 + E * HID * 2
    bw = res["copy_tb_s"] * 1e12
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    print(f"{name}, copy {res['copy_tb_s']:.2f} TB/s, {nbytes / 1e6:.1f} MB a token:", flush=True)
    for name in ("fused_flag", "fused_slot_words", "two_launches"):
        us = res[f"{name}_us"]
        res[f"{name}_roofline"] = nbytes / (us * 1e-6) / bw
        print(f"  {name:18s} {us:7.2f} us ({res[f'{name}_roofline']:.0%})", flush=True)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
