"""FlashMLA's dense decode (kernels/flashmla) against an fp32 reference and against Tandem's Triton all-heads
kernel, on the H200, at Kimi-Linear's MLA shape (32 heads over one latent head of 512 + 64, bf16, pages of 64).

    python -m bench.flashmla_check --out flashmla_check.json      # on the GPU; the first run builds (~1-3 min)

Every workload runs twice: every sequence at the full context ("equal") and a context drawn per sequence in
[1, ctx] ("mixed": the case the TMA experiment got wrong). Correctness: max |err| of each kernel vs an fp32
gather-softmax reference over the same bf16 inputs. Speed: ms per call (CUDA events, kernel + its planning
and combine launches), the latent bytes read once over that time, against the copy bandwidth measured here.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.gpu_kernels_check import timed
from bench.mid.roofline import copy_bandwidth
from kernels.flashmla.build import load_flashmla
from kernels.flashmla.decode import flashmla_decode_fwd
from kernels.paged_attention.mla_decode import mla_decode_fwd

HEADS, RANK, ROPE, PAGE = 32, 512, 64, 64
SCALE = (128 + 64) ** -0.5


def workload(batch: int, ctx: int, mixed: bool, device: torch.device, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    if mixed:
        lens = torch.randint(1, ctx + 1, (batch,), generator=gen, device=device)
    else:
        lens = torch.full((batch,), ctx, device=device)
    pages_per_seq = -(-ctx // PAGE)
    num_pages = batch * pages_per_seq + 1
    latent = torch.randn(num_pages, PAGE, RANK + ROPE, generator=gen, device=device).to(torch.bfloat16)
    perm = torch.randperm(num_pages - 1, generator=gen, device=device)[: batch * pages_per_seq] + 1
    tables = perm.view(batch, pages_per_seq).to(torch.int32)
    q_lat = torch.randn(batch, HEADS, RANK, generator=gen, device=device).to(torch.bfloat16)
    q_pe = torch.randn(batch, HEADS, ROPE, generator=gen, device=device).to(torch.bfloat16)
    return q_lat, q_pe, latent, tables, lens.to(torch.int32)


def reference(q_lat, q_pe, latent, tables, lens) -> torch.Tensor:
    """fp32 softmax attention per sequence over its gathered latent rows."""
    out = torch.empty(q_lat.shape, dtype=torch.float32, device=q_lat.device)
    q = torch.cat([q_lat, q_pe], -1).float()
    for i, n in enumerate(lens.tolist()):
        rows = latent[tables[i, : -(-n // PAGE)].long()].reshape(-1, RANK + ROPE)[:n].float()
        p = torch.softmax(q[i] @ rows.T * SCALE, dim=-1)
        out[i] = p @ rows[:, :RANK]
    return out


def check(batch: int, ctx: int, mixed: bool, device: torch.device, copy_bw: float) -> dict:
    q_lat, q_pe, latent, tables, lens = workload(batch, ctx, mixed, device)
    ref = reference(q_lat, q_pe, latent, tables, lens)
    runs = {
        "flashmla": lambda: flashmla_decode_fwd(q_lat, q_pe, latent, tables, lens, SCALE),
        "triton": lambda: mla_decode_fwd(q_lat, q_pe, latent, tables, lens, ctx, SCALE),
    }
    nbytes = int(lens.sum()) * (RANK + ROPE) * latent.element_size()
    row = {"batch": batch, "ctx": ctx, "contexts": "mixed" if mixed else "equal", "latent_bytes": nbytes}
    for name, fn in runs.items():
        err = (fn().float() - ref).abs().max().item()
        ms = timed(fn, warmup=3, iters=20)
        row[name] = {"max_err": err, "ms": ms, "bw_ratio": nbytes / (ms * 1e-3) / copy_bw}
    row["speedup"] = row["triton"]["ms"] / row["flashmla"]["ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="*", default=["64x32768", "64x4096", "16x32768", "1x32768", "64x100"])
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    device = torch.device("cuda")
    t0 = time.perf_counter()
    load_flashmla(verbose=False)
    build_s = time.perf_counter() - t0
    bw = copy_bandwidth(device)
    print(f"FlashMLA build/load {build_s:.1f} s; copy bandwidth {bw['bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    rows = []
    for w in a.workloads:
        batch, ctx = map(int, w.split("x"))
        for mixed in (False, True):
            r = check(batch, ctx, mixed, device, bw["bytes_per_s"])
            rows.append(r)
            f, t = r["flashmla"], r["triton"]
            print(
                f"{w:>9} {r['contexts']:>5}: flashmla {f['ms']:.3f} ms ({f['bw_ratio']:.0%}, err {f['max_err']:.2e})"
                f"  triton {t['ms']:.3f} ms ({t['bw_ratio']:.0%}, err {t['max_err']:.2e})  x{r['speedup']:.2f}",
                flush=True,
            )
    if a.out:
        a.out.write_text(json.dumps({"build_s": build_s, "copy_bw": bw, "rows": rows}, indent=1))
    bad = [r for r in rows if r["flashmla"]["max_err"] > 2e-2 or r["triton"]["max_err"] > 2e-2]
    print("all within 2e-2 of the fp32 reference" if not bad else f"{len(bad)} workloads off the reference")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
