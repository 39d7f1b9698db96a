"""What an L2 prefetch (kernels/prefetch/triton.py) buys a GEMV after a latency-bound window, on the GPU.

    python -m bench.l2_prefetch --out l2_prefetch.json     # one GPU, ~30 s

Each case is one CUDA graph of ``ITERS`` rounds of: a 256 MB memset (L2 holds nothing of the weights), optionally
the prefetch launch, a spin of ``gap`` us on one thread (``torch.cuda._sleep``: the stand-in for the short conv,
the recurrence, the attention's split and combine, which leave HBM idle), then the consumer GEMVs
(kernels/gemv). The prefetch is launched in the round's stream ("serial") or as the engine does
(engine/backends/prefetch.py, "forked": on a side stream, joined back before the consumer). "cold" is the
consumer's time (the round less the same round without it); "with prefetch" is the round with the prefetch
less the round with neither, so it includes what the prefetch costs the stream; "hot" is the consumer alone,
repeated with nothing between (its weights stay in L2: the floor a prefetch can reach). Weights: the mid
model's o_proj (19 MB), the shared expert's gate | up and down (9.4 + 4.7 MB), and KDA's in_proj (58 MB, larger
than what L2 keeps)."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

import kernels.prefetch.triton as pf
from bench.graph_time import graph_us
from engine.backends.prefetch import L2Prefetch
from kernels.gemv.triton import gemv

ITERS = 10
WEIGHTS = {  # name -> [(N, K)] consumed one after another by one-row GEMVs
    "o_proj": [(2304, 4096)],
    "shared_expert": [(2048, 2304), (2304, 1024)],
    "in_proj": [(12576, 2304)],
}


def _cycles_per_us() -> float:
    a = graph_us(lambda: torch.cuda._sleep(200_000), iters=5)
    b = graph_us(lambda: torch.cuda._sleep(100_000), iters=5)
    return 100_000 / (a - b)


def run(gaps: list[float], chunks: list[int], modes: list[str]) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    cyc = _cycles_per_us()
    out: dict = {"device": torch.cuda.get_device_name(), "cycles_per_us": cyc, "cases": []}
    forked = L2Prefetch(max_rows=1)
    for name, shapes in WEIGHTS.items():
        ws = [torch.randn(s, device=dev, dtype=torch.bfloat16, generator=g) for s in shapes]
        xs = [torch.randn(1, s[1], device=dev, dtype=torch.bfloat16, generator=g) for s in shapes]
        nbytes = sum(w.numel() * 2 for w in ws)

        def consume(ws=ws, xs=xs):
            for w, x in zip(ws, xs, strict=True):
                gemv(x, w)

        hot = graph_us(consume, iters=ITERS)
        for mode, chunk, gap in itertools.product(modes, chunks, gaps):
            pf.CHUNK_BYTES = chunk
            spin = int(gap * cyc)

            def rnd(prefetch: bool, use: bool, ws=ws, consume=consume, spin=spin, mode=mode):
                flush.zero_()
                if prefetch and mode == "serial":
                    pf.l2_prefetch(*ws)
                elif prefetch:
                    forked.weights(1, *ws)
                if spin:
                    torch.cuda._sleep(spin)
                forked.join()
                if use:
                    consume()

            base = graph_us(lambda rnd=rnd: rnd(False, False), iters=ITERS)
            cold = graph_us(lambda rnd=rnd: rnd(False, True), iters=ITERS) - base
            warm = graph_us(lambda rnd=rnd: rnd(True, True), iters=ITERS) - base
            alone = graph_us(lambda rnd=rnd: rnd(True, False), iters=ITERS) - base
            row = {
                "mode": mode,
                "weights": name,
                "mbytes": nbytes / 1e6,
                "chunk": chunk,
                "gap_us": gap,
                "cold_us": cold,
                "prefetched_us": warm,
                "hot_us": hot,
                "prefetch_alone_us": alone,
                "saved_us": cold - warm,
            }
            out["cases"].append(row)
            print(
                f"{mode:6s} {name:14s} {nbytes / 1e6:5.1f} MB chunk {chunk:6d} gap {gap:5.1f} us:"
                f" consumer cold {cold:6.2f}  with prefetch {warm:6.2f}  hot {hot:6.2f}"
                f"  | prefetch's own cost {alone:5.2f}"
                f"  saved {cold - warm:6.2f} us",
                flush=True,
            )
    pf.CHUNK_BYTES = 4096
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.l2_prefetch", description=__doc__.splitlines()[0])
    p.add_argument("--gaps", type=float, nargs="+", default=[0.0, 4.0, 8.0, 16.0])
    p.add_argument("--chunks", type=int, nargs="+", default=[4096])
    p.add_argument("--modes", nargs="+", choices=["serial", "forked"], default=["serial", "forked"])
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.l2_prefetch needs a CUDA GPU")
    res = run(a.gaps, a.chunks, a.modes)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
