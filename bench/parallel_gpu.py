"""Issue 6 on two GPUs (NCCL): parallel layouts on the mid-shape checkpoints, each against one rank.

    python -m bench.parallel_gpu --arch kimi_linear --layouts single pcp2 --out /tmp/par-kimi-a.json
    python -m bench.parallel_gpu --arch kimi_linear --layouts pp2 tp2 --out /tmp/par-kimi-b.json
    python -m bench.parallel_gpu --report /tmp/par-kimi-a.json /tmp/par-kimi-b.json   # the table, speed-ups
    python -m bench.parallel_gpu --tiny --arch qwen3 --layouts single pcp2 pp2 tp2    # host check (gloo)

Workloads (every layout runs only its own; 'single' runs all three as the baseline):

    pcp  prefill of one prompt of 16k / 32k / 64k tokens (one chunk): seconds, tokens/s   single vs pcp2
    pp   prefill throughput of a batch of prompts (8 x 4096 tokens)                       single vs pp2
    tp   decode step time of a running batch (16 x 4096 context)                          single vs tp2

Checkpoints: bench/mid/checkpoint.py (Kimi-Linear mid shape; Qwen3-8B layer shape), 8 layers, written once
to /tmp. Each layout is one engine, started and closed in turn; every rank process compiles its kernels
and (Kimi) autotunes fla's chunk_kda, so split the layouts over several commands if one exceeds the time
limit (TRITON_CACHE_AUTOTUNING=1 keeps autotune results on disk between processes on Triton >= 3.2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from bench.mid import gaps
from bench.mid.checkpoint import MidSpec, write_mid_model
from bench.parallel import _prompts, decode_step_ms, prefill_seconds
from engine.config import EngineConfig
from engine.parallel import create_engine
from engine.parallel.config import ParallelConfig
from engine.sampling_params import SamplingParams

LAYOUTS = {
    "single": ParallelConfig(),
    "pcp2": ParallelConfig(pcp=2),
    "pp2": ParallelConfig(pp=2),
    "pp2m4": ParallelConfig(pp=2, pp_microbatches=4),  # smaller pipeline bubble: (pp - 1) / (m + pp - 1)
    "tp2": ParallelConfig(tp=2),
}
AGREE_TOKENS = 8  # greedy tokens after each PCP prompt, compared with one GPU's (bf16: a near-tie may flip)
WORKLOADS = {"single": ("pcp", "pp", "tp"), "pcp2": ("pcp",), "pp2": ("pp",), "pp2m4": ("pp",), "tp2": ("tp",)}


def _defaults(a: argparse.Namespace, cuda: bool) -> None:
    big = cuda and not a.tiny
    a.pcp_lens = a.pcp_lens or ([16384, 32768, 65536] if big else [256, 512])
    a.pp_batch = a.pp_batch or (8 if big else 4)
    a.pp_len = a.pp_len or (4096 if big else 128)
    a.tp_batch = a.tp_batch or (16 if big else 4)
    a.tp_ctx = a.tp_ctx or (4096 if big else 128)
    a.kv_bytes = int(a.kv_gib * (1 << 30)) if cuda else 64 << 20


def _engine(a: argparse.Namespace, layout: str, device: str, dtype: str) -> Any:
    longest = max(*a.pcp_lens, a.pp_len, a.tp_ctx)
    cfg = EngineConfig(
        model=str(a.model_dir),
        device=device,
        dtype=dtype,
        max_num_seqs=max(a.pp_batch, a.tp_batch),
        max_num_batched_tokens=max(*a.pcp_lens, a.pp_batch * a.pp_len),
        max_model_len=longest + a.decode_steps + 64,
        kv_cache_memory_bytes=a.kv_bytes,
        parallel=LAYOUTS[layout],
    )
    return create_engine(cfg)


def run_layout(a: argparse.Namespace, layout: str, device: str, dtype: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    eng = _engine(a, layout, device, dtype)
    rec: dict[str, Any] = {"arch": a.arch, "layout": layout, "startup_s": time.perf_counter() - t0}
    vocab = eng.model_config.vocab_size
    try:
        t1 = time.perf_counter()
        eng.generate(_prompts(1, min(512, a.pcp_lens[0]), vocab, 0), None)  # compile / autotune
        rec["first_call_s"] = time.perf_counter() - t1
        work = [w for w in WORKLOADS[layout] if not a.workloads or w in a.workloads]
        if "pcp" in work:
            rec["pcp"] = {}
            for n in a.pcp_lens:
                s = prefill_seconds(eng, _prompts(1, n, vocab, n), a.repeat)
                if a.trace_dir:
                    _trace(a, f"{a.arch}-{layout}-{n}", eng, _prompts(1, n, vocab, n))
                greedy = SamplingParams(max_tokens=AGREE_TOKENS, temperature=0, ignore_eos=True)
                tokens = eng.generate(_prompts(1, n, vocab, n), greedy)[0].output_token_ids
                rec["pcp"][str(n)] = {"seconds": s, "tokens_per_s": n / s, "tokens": list(tokens)}
                print(f"{a.arch} {layout} prefill {n}: {s * 1e3:.1f} ms", flush=True)
        if "pp" in work:
            s = prefill_seconds(eng, _prompts(a.pp_batch, a.pp_len, vocab, 2), a.repeat)
            rec["pp"] = {"batch": a.pp_batch, "len": a.pp_len, "seconds": s, "tokens_per_s": a.pp_batch * a.pp_len / s}
            print(f"{a.arch} {layout} batch prefill: {rec['pp']['tokens_per_s']:,.0f} tok/s", flush=True)
        if "tp" in work:
            ms = decode_step_ms(eng, _prompts(a.tp_batch, a.tp_ctx, vocab, 3), a.decode_steps)
            rec["tp"] = {"batch": a.tp_batch, "ctx": a.tp_ctx, "step_ms": ms}
            print(f"{a.arch} {layout} decode step: {ms:.2f} ms", flush=True)
    except Exception as err:
        rec["error"] = f"{type(err).__name__}: {err}"[:500]
        print(f"{a.arch} {layout} FAILED: {rec['error']}", flush=True)
        traceback.print_exc()  # where it failed (a device-side assert: run with CUDA_LAUNCH_BLOCKING=1)
    finally:
        eng.close()
    return rec


def _trace(a: argparse.Namespace, name: str, eng: Any, prompts: list[list[int]]) -> None:
    """One more run under torch.profiler on this (the driver's, rank 0's) process: the whole step, host and
    device, as a trace, and where the device waited (bench/mid/gaps.py)."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    a.trace_dir.mkdir(parents=True, exist_ok=True)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    with torch.profiler.profile(activities=acts) as prof:
        eng.generate(prompts, one)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    path = a.trace_dir / f"{name}.json.gz"
    prof.export_chrome_trace(str(path))
    print(gaps.report(name, gaps.summarise(gaps.load_events(path))), flush=True)


def _speedup(mine: float, base: float, lower_is_better: bool) -> str:
    return f"{(base / mine if lower_is_better else mine / base):.2f}x"


def report(records: list[dict[str, Any]]) -> str:
    lines = ["| model | workload | layout | value | vs one GPU |", "|---|---|---|---|---|"]
    base = {r["arch"]: r for r in records if r["layout"] == "single"}
    for r in records:
        b = base.get(r["arch"], {})
        if "error" in r:
            lines.append(f"| {r['arch']} | - | {r['layout']} | failed: {r['error'][:100]} | |")
        for n, v in r.get("pcp", {}).items():
            ref = b.get("pcp", {}).get(n)
            sp = _speedup(v["seconds"], ref["seconds"], True) if ref else "-"
            if ref and "tokens" in v and "tokens" in ref and r["layout"] != "single":
                pairs = enumerate(zip(v["tokens"], ref["tokens"], strict=True))
                same = next((i for i, (x, y) in pairs if x != y), len(v["tokens"]))
                sp += f" (greedy: first {same} of {len(v['tokens'])} tokens as one GPU)"
            lines.append(f"| {r['arch']} | prefill {n} tokens | {r['layout']} | {v['seconds'] * 1e3:,.0f} ms | {sp} |")
        if "pp" in r:
            v, ref = r["pp"], b.get("pp")
            sp = _speedup(v["tokens_per_s"], ref["tokens_per_s"], False) if ref else "-"
            what = f"prefill {v['batch']} x {v['len']}"
            lines.append(f"| {r['arch']} | {what} | {r['layout']} | {v['tokens_per_s']:,.0f} tok/s | {sp} |")
        if "tp" in r:
            v, ref = r["tp"], b.get("tp")
            sp = _speedup(v["step_ms"], ref["step_ms"], True) if ref else "-"
            what = f"decode step, {v['batch']} x {v['ctx']} ctx"
            lines.append(f"| {r['arch']} | {what} | {r['layout']} | {v['step_ms']:.2f} ms | {sp} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.parallel_gpu", description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="kimi_linear", choices=("kimi_linear", "qwen3"))
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (host check under gloo)")
    p.add_argument("--pcp-lens", type=int, nargs="*", default=None)
    p.add_argument("--pp-batch", type=int, default=None)
    p.add_argument("--pp-len", type=int, default=None)
    p.add_argument("--tp-batch", type=int, default=None)
    p.add_argument("--tp-ctx", type=int, default=None)
    p.add_argument("--workloads", nargs="*", default=None, choices=("pcp", "pp", "tp"), help="default: all of each")
    p.add_argument("--trace-dir", type=Path, default=None, help="keep a profiler trace of one more run per prompt")
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--kv-gib", type=float, default=8.0)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--report", type=Path, nargs="*", default=None, help="only print the table of these JSON files")
    a = p.parse_args(argv)
    if a.report:
        recs = [r for f in a.report for r in json.loads(f.read_text())]
        print(report(recs))
        return 0
    cuda = torch.cuda.is_available()
    _defaults(a, cuda)
    if not cuda:
        torch.set_num_threads(1)
    short = "kimi" if a.arch == "kimi_linear" else "qwen3"
    a.model_dir = a.model_dir or Path(f"/tmp/tandem-mid-{short}-{a.layers}l{'-tiny' if a.tiny else ''}")
    write_mid_model(a.model_dir, MidSpec(a.arch, a.layers, a.tiny))
    dtype = a.dtype or ("bfloat16" if cuda else "float32")
    records = []
    for layout in a.layouts:
        records.append(run_layout(a, layout, "cuda" if cuda else "cpu", dtype))
        if a.out:  # after each layout: a run cut by the time limit keeps what it measured
            a.out.write_text(json.dumps(records, indent=1))
    print(report(records))
    if a.out:
        print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
