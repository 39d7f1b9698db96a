"""The one-token MoE routing inside the gate-up launch (kernels/moe/route_gate_up.py) against the two launches it
replaces (``router_route``, then the pair-row gate-up), alone, at Kimi-Linear's shapes (hidden 2304, 256 experts
top-8 + the shared one, 1024 wide), random bf16 weights.

    python -m bench.moe_route_gate_up [--tokens 16] [--copies 8] [--out route_gate_up.json]      # GPU, ~1 min

The fused launch twice: its routed programs told their experts by the flag (the default) and by the slot words
(``slot_words=True``, ``TANDEM_MOE_ROUTE_SLOT_WORDS=1``). Then the whole MoE block: that launch and the down
launch with the combine + norm (``down_combine_norm``, the default) against the block in one launch
(``route_gate_up_down_norm``, ``TANDEM_MOE_BLOCK_ONE_LAUNCH=1``).

Each launch gets the next of ``--tokens`` different tokens, so each routes to other experts and their weights come
from HBM. The router's weight, its bias and the shared expert rotate over ``--copies`` copies (default 8: ~85 MB
of them, past the L2), so they come from HBM too, as in a decode step, where every other layer's weights pass
through the L2 between two calls of one layer. With ``--copies 1`` they stay in L2 from call to call: the
thirty-seventh session's H100 numbers came that way, and there the slot words beat the flag by 3 us a launch
while in the step they lost 1.3 us (docs/PERFORMANCE.md). Times are CUDA-graph replays (``bench.graph_time``).
Every token's fused output is checked bit for bit against the two launches first."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.graph_time import graph_us
from bench.mid.roofline import copy_bandwidth
from kernels.moe import route_gate_up as fused_module
from kernels.moe.down_norm import down_combine_norm

HID, E, INTER, TOP_K = 2304, 256, 1024, 8
BLOCK_WAITS = {  # the one-launch block's down programs: (ns between polls, their rows into L2 before the wait)
    "block_one_launch": (0, False),
    "block_one_launch_poll100": (100, False),
    "block_one_launch_poll500": (500, False),
    "block_one_launch_prefetch": (0, True),
    "block_one_launch_prefetch_poll500": (500, True),
}


def two_launches(x, w, ticket, bias, w13, shared):
    return fused_module.route_then_gate_up(x, w, ticket, bias, TOP_K, True, 2.446, w13, extra_expert=shared)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.moe_route_gate_up", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--copies", type=int, default=8, help="copies of the router and the shared expert, in turn")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--device", default="cuda", help="cuda (cpu: the code path under TRITON_INTERPRET=1, in tests)")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    if a.tokens < 1 or a.copies < 1:
        raise SystemExit(f"--tokens and --copies must be >= 1, got {a.tokens} and {a.copies}")
    gen = torch.Generator(device=dev).manual_seed(0)
    xs = [torch.randn(1, HID, generator=gen, device=dev).to(torch.bfloat16) for _ in range(a.tokens)]
    ws = [(torch.randn(E, HID, generator=gen, device=dev) / HID**0.5).to(torch.bfloat16) for _ in range(a.copies)]
    biases = [0.1 * torch.randn(E, generator=gen, device=dev) for _ in range(a.copies)]
    # experts E .. E + copies - 1: the shared expert's copies (never routed: the routing picks among the first E)
    w13 = (torch.randn(E + a.copies, 2 * INTER, HID, generator=gen, device=dev) / HID**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E + a.copies, HID, INTER, generator=gen, device=dev) / INTER**0.5).to(torch.bfloat16)
    residual = torch.randn(1, HID, generator=gen, device=dev).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(HID, generator=gen, device=dev)).to(torch.bfloat16)
    sync = torch.zeros(fused_module.SYNC_SIZE, dtype=torch.int32, device=dev)
    ticket = torch.zeros(1, dtype=torch.int32, device=dev)

    def case(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Call i's (token, router weight, bias, shared expert)."""
        c = i % a.copies
        return xs[i % a.tokens], ws[c], biases[c], E + c

    def fused(i: int, slot_words: bool) -> tuple[torch.Tensor, ...]:
        x, w, bias, shared = case(i)
        return fused_module.route_gate_up(
            x, w, sync, bias, TOP_K, True, 2.446, w13, extra_expert=shared, slot_words=slot_words
        )

    def unfused(i: int) -> tuple[torch.Tensor, ...]:
        x, w, bias, shared = case(i)
        return two_launches(x, w, ticket, bias, w13, shared)

    def block_two_launches(i: int) -> tuple[torch.Tensor, ...]:
        weights, ids, rows = fused(i, False)
        return down_combine_norm(rows, ids.reshape(-1), w2, weights, residual, norm_w, 1e-6, ticket)

    def block_one_launch(i: int, poll_ns: int = 0, prefetch: bool = False) -> tuple[torch.Tensor, ...]:
        x, w, bias, shared = case(i)
        return fused_module.route_gate_up_down_norm(
            x, w, sync, bias, TOP_K, True, 2.446, w13, w2, residual, norm_w, 1e-6, extra_expert=shared,
            poll_ns=poll_ns, prefetch=prefetch,
        )  # fmt: skip

    for i in range(max(a.tokens, a.copies)):
        want = unfused(i)
        for slot_words in (False, True):
            if not all(torch.equal(g, t) for g, t in zip(fused(i, slot_words), want, strict=True)):
                raise SystemExit(f"the fused launch (slot_words={slot_words}) differs from the two launches")
        for poll_ns, prefetch in BLOCK_WAITS.values():
            got = block_one_launch(i, poll_ns, prefetch)
            if not all(torch.equal(g, t) for g, t in zip(got, block_two_launches(i), strict=True)):
                raise SystemExit(f"the MoE block in one launch differs ({poll_ns} ns polls, prefetch {prefetch})")
    turn = [0]

    def next_case() -> int:
        turn[0] += 1
        return turn[0]

    calls = max(16, a.tokens, a.copies)  # calls a graph: every token and every copy in turn
    res = {
        "fused_flag_us": graph_us(lambda: fused(next_case(), False), calls),
        "fused_slot_words_us": graph_us(lambda: fused(next_case(), True), calls),
        "two_launches_us": graph_us(lambda: unfused(next_case()), calls),
        "block_two_launches_us": graph_us(lambda: block_two_launches(next_case()), calls),
        **{
            f"{name}_us": graph_us(lambda wait=wait: block_one_launch(next_case(), *wait), calls)
            for name, wait in BLOCK_WAITS.items()
        },
        "copies": a.copies,
        "copy_tb_s": copy_bandwidth(dev)["bytes_per_s"] / 1e12,
    }
    if sync.any() or ticket.any():
        raise SystemExit(f"counters not back at 0: {sync.tolist()} {ticket.tolist()}")
    nbytes = (TOP_K + 1) * 2 * INTER * HID * 2 + E * HID * 2
    block_bytes = nbytes + (TOP_K + 1) * HID * INTER * 2
    bw = res["copy_tb_s"] * 1e12
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    print(
        f"{name}, copy {res['copy_tb_s']:.2f} TB/s, {nbytes / 1e6:.1f} MB a token (the block {block_bytes / 1e6:.1f} "
        f"MB), {a.copies} copies of the router and the shared expert:",
        flush=True,
    )
    for name in ("fused_flag", "fused_slot_words", "two_launches", "block_two_launches", *BLOCK_WAITS):
        us = res[f"{name}_us"]
        res[f"{name}_roofline"] = (block_bytes if name.startswith("block") else nbytes) / (us * 1e-6) / bw
        print(f"  {name:34s} {us:7.2f} us ({res[f'{name}_roofline']:.0%})", flush=True)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
