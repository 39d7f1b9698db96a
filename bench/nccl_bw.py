"""Collective bandwidth between the GPUs of one host (NCCL), the ceiling under PCP's exchanges.

    python -m bench.nccl_bw [--gpus 2] [--mib 64 256] [--out nccl.json]

One process per GPU. For each size: all_gather_into_tensor, all_to_all_single and all_reduce of bf16,
median of 10 after 3 warm-ups. "bytes/s" is what one rank receives per second (all-gather / all-to-all:
(n-1)/n of the output; all-reduce: the bus bandwidth convention 2(n-1)/n x size), next to a device copy
of the same size on GPU 0 as the memory-bandwidth reference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _worker(rank: int, n: int, sizes: list[int], port: int, out: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    rows = []
    for mib in sizes:
        elems = (mib << 20) // 2
        x = torch.randn(elems // n, device="cuda").to(torch.bfloat16)
        big = torch.empty(elems, dtype=torch.bfloat16, device="cuda")
        a2a_in = torch.randn(elems, device="cuda").to(torch.bfloat16)
        a2a_out = torch.empty_like(a2a_in)
        red = torch.randn(elems, device="cuda").to(torch.bfloat16)
        moved = (mib << 20) * (n - 1) / n
        res = {
            "MiB": mib,
            "all_gather_GBps": moved / _time(lambda: dist.all_gather_into_tensor(big, x)) / 1e9,  # noqa: B023
            "all_to_all_GBps": moved / _time(lambda: dist.all_to_all_single(a2a_out, a2a_in)) / 1e9,  # noqa: B023
            "all_reduce_busbw_GBps": 2 * moved / _time(lambda: dist.all_reduce(red)) / 1e9,  # noqa: B023
        }
        if rank == 0:
            src = torch.empty(elems, dtype=torch.bfloat16, device="cuda")
            res["device_copy_GBps"] = 2 * (mib << 20) / _time(lambda: big.copy_(src)) / 1e9  # noqa: B023
            rows.append(res)
            print(json.dumps(res), flush=True)
    if rank == 0 and out:
        env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        Path(out).write_text(json.dumps({"gpus": n, "nccl_env": env, "rows": rows}, indent=1))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.nccl_bw", description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--mib", type=int, nargs="*", default=[16, 64, 256])
    p.add_argument("--port", type=int, default=29531)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if torch.cuda.device_count() < a.gpus:
        print(f"needs {a.gpus} GPUs, found {torch.cuda.device_count()}")
        return 2
    mp.spawn(_worker, args=(a.gpus, a.mib, a.port, a.out), nprocs=a.gpus)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
