"""The one-token MoE route + gate-up launch (kernels/moe/route_gate_up.py) in the engine, watched: for a launch
that seems to hang.

Session 35 (H100) took this launch for a hang: the mid model's b1 decode with ``TANDEM_MOE_ROUTE_GATE_UP=1`` printed
nothing in 150 s. Session 36 (H200) ran this first on a fresh machine and it timed out in the *prefill*, in Triton's
compiler: a cold Triton cache alone takes longer than that. On a warm cache every counter was at 0 before and
after each launch, and the graph steps ran. This runs the same engine with it on: every eager launch synchronised,
with the counters printed before and after (a word not at 0 before a launch makes its routed programs wait
forever), captures noted, then a few timed graph steps. Ten seconds before ``--timeout`` a watchdog thread copies
the counters to the host on a stream of its own (the copy engine runs while a kernel spins) and prints them; at
``--timeout`` every thread's Python stack is printed and the process exits (the stuck call). Give a fresh
machine's first run minutes, not seconds.

    python -m bench.moe_block_hang [--ctx 4096] [--timeout 110]
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import threading
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.moe_block_hang", description=__doc__.splitlines()[0])
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--timeout", type=int, default=110)
    p.add_argument("--calls", type=int, default=10, help="eager launches to synchronise and print")
    a = p.parse_args(argv)
    os.environ["TANDEM_MOE_ROUTE_GATE_UP"] = "1"
    faulthandler.dump_traceback_later(a.timeout, exit=True)
    import torch

    import engine.backends.gpu_moe as gpu_moe
    from bench.decode_timeline import _experts_touched_eagerly
    from bench.mid import tandem_bench

    real, calls, seen = gpu_moe.route_gate_up, [0], {}

    def watchdog() -> None:
        """The counters as the stuck launch left them: which word never came back to 0 says who waits."""
        side = torch.cuda.Stream()
        for sync in list(seen.values()):
            host = torch.empty(sync.shape, dtype=torch.int32, pin_memory=True)
            with torch.cuda.stream(side):
                host.copy_(sync, non_blocking=True)
            side.synchronize()
            print(
                f"watchdog at {a.timeout - 10} s, launch {calls[0]}: counters "
                "(router ticket, routed count, flag, slots' words, down ticket, slots' gate-up counts) "
                f"{host.tolist()}",
                flush=True,
            )

    timer = threading.Timer(max(a.timeout - 10, 1), watchdog)
    timer.daemon = True
    timer.start()

    def traced(x: torch.Tensor, w: torch.Tensor, sync: torch.Tensor, *rest: Any, **kw: Any) -> Any:
        calls[0] += 1
        seen.setdefault(sync.data_ptr(), sync)
        capturing = torch.cuda.is_current_stream_capturing()
        loud = not capturing and calls[0] <= a.calls
        if loud:
            torch.cuda.synchronize()
            print(f"call {calls[0]}: x {tuple(x.shape)} strides {x.stride()} counters {sync.tolist()}", flush=True)
        out = real(x, w, sync, *rest, **kw)
        if loud:
            torch.cuda.synchronize()
            print(f"  done: ids {out[1].tolist()} counters {sync.tolist()}", flush=True)
        elif capturing:
            print(f"call {calls[0]}: captured", flush=True)
        return out

    gpu_moe.route_gate_up = traced
    t0 = time.perf_counter()
    eng = tandem_bench.lone_prompt_engine(
        8, False, [a.ctx + 64], 16.0, max_num_seqs=1, cuda_graphs=True, async_scheduling=True
    )
    rids = tandem_bench.fill_decode_batch(eng, a.ctx, 1)
    print(f"prefilled in {time.perf_counter() - t0:.0f} s; launches so far {calls[0]}", flush=True)
    print("experts touched (eager step, routed apart)", _experts_touched_eagerly(eng), flush=True)
    eng.overlap, overlap = None, eng.overlap  # one eager step with the fused launch
    for g in (eng.runner.decode_graphs, eng.runner.prefill_graphs):
        if g is not None:
            g.enabled = False
    eng.step()
    torch.cuda.synchronize()
    print(f"eager step done; launches {calls[0]}", flush=True)
    for g in (eng.runner.decode_graphs, eng.runner.prefill_graphs):
        if g is not None:
            g.enabled = True
    eng.overlap = overlap
    times = tandem_bench.decode_steps_timed(eng, 5, warmup=2)
    print(f"graph steps: median {times.median * 1e6:.1f} us; launches {calls[0]}", flush=True)
    tandem_bench.clear(eng, rids)
    timer.cancel()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
