"""Issue 5 on one GPU: Kimi-Linear at real per-layer shapes (few layers, random bf16 weights), Tandem vs HF.

    python -m bench.gpu_mid --out /tmp/gpu_mid.json              # on the H200: everything, one process
    python -m bench.gpu_mid --tiny --out /tmp/gpu_mid_cpu.json    # on the host: tiny shapes, seconds

One process (fla's chunk_kda compiles and autotunes ~90 s on its first call per process):

1. measured ceilings: bf16 matmul peak and device copy bandwidth (bench/mid/roofline.py);
2. Tandem prefill of 8k / 32k prompts: tokens/s and MFU = model FLOPs / time / matmul peak (FLOP formula:
   bench/mid/costs.py -- causal attention pairs, active experts only);
3. Tandem decode step time at batch 1 / 16 / 64 x context 4k / 32k (batches filled by one prefill plus page /
   state copies, bench/mid/tandem_bench.py), bytes a step must move / measured copy bandwidth = roofline ratio;
4. per-op breakdown (attention / KDA / MoE / GEMM / other) of one prefill and one decode step, and the host
   (Python) overhead per decode step at the largest batch: step wall time minus GPU kernel time;
5. eager vs CUDA-graph decode (step time, token agreement) when the engine supports graphs;
6. the same prefill / decode workloads through HF transformers' KimiLinearForCausalLM (failures such as OOM
   are reported in the table, never raised).

Prints markdown tables and writes the JSON to --out. On the host (no CUDA) HF runs its pure-torch path
(fla blocked: its Triton kernels need a GPU) and the ceilings are CPU numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.mid import costs, hf_bench, profile, roofline, tandem_bench
from bench.mid.checkpoint import MidSpec, write_mid_model
from bench.mid.moe_ab import run_moe_prefill_ab
from bench.mid.report import render
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def _defaults(a: argparse.Namespace, cuda: bool) -> None:
    big = cuda and not a.tiny
    a.prefill = a.prefill or ([8192, 32768] if big else [256, 1024])
    a.ctx = a.ctx or ([4096, 32768] if big else [128, 512])
    a.batches = a.batches or ([1, 16, 64] if big else [1, 4, 8])
    a.kv_bytes = int(a.kv_gib * (1 << 30)) if cuda else 256 << 20


def _engine(a: argparse.Namespace, device: str, dtype: str, **kw: Any) -> LLMEngine:
    longest = max([*a.prefill, *a.ctx])
    cfg = EngineConfig(
        model=str(a.model_dir),
        device=device,
        dtype=dtype,
        max_num_seqs=max(a.batches),
        max_num_batched_tokens=max(a.prefill),
        max_model_len=longest + a.decode_steps + 64,
        kv_cache_memory_bytes=a.kv_bytes,
        **({"page_size": a.page_size} if a.page_size else {}),
        **kw,
    )
    return LLMEngine(cfg)


def run_tandem(a: argparse.Namespace, eng: LLMEngine, res: dict[str, Any]) -> None:
    """Eager-path numbers (decode graphs off here; run_graphs compares them)."""
    for graphs in (getattr(eng.runner, "decode_graphs", None), getattr(eng.runner, "prefill_graphs", None)):
        if graphs is not None:
            graphs.enabled = False
    dev, cfg = eng.device, eng.model_config
    peak = res["ceilings"]["matmul"]["flops_per_s"]
    bw = res["ceilings"]["copy"]["bytes_per_s"]
    vocab = cfg.vocab_size
    warm = min(512, *a.prefill)
    _, first = tandem_bench.timed(lambda: eng.prompt_logits(tandem_bench.prompt(warm, vocab, 0)), dev)
    res["notes"].append(f"first Tandem forward ({warm} tokens, kernel compile + fla autotune): {first:.1f} s")
    logits = eng.prompt_logits(tandem_bench.prompt(warm, vocab, 1))
    if not torch.isfinite(logits).all():
        raise RuntimeError("non-finite logits from the mid model: fix the init scales before trusting timings")
    for length in a.prefill:
        t, _ = tandem_bench.prefill_seconds(eng, tandem_bench.prompt(length, vocab, length), a.repeat)
        fl = costs.prefill_flops(cfg, length)
        res["prefill"].append(
            {"length": length, "seconds": t, "tokens_per_s": length / t, "flops": fl, "mfu": fl["total"] / t / peak}
        )
        print(f"tandem prefill {length}: {length / t:,.0f} tok/s", flush=True)
    ids = tandem_bench.prompt(a.prefill[0], vocab, 3)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    with profile.labelled_ops(eng.model):  # a one-token generate: logits of the last row only, as served
        prof = profile.profiled(lambda: eng.generate([ids], one), dev, stacks=True)
    res["breakdown"][f"prefill {a.prefill[0]}"] = profile.breakdown(prof, dev)
    res["top_kernels"][f"prefill {a.prefill[0]}"] = profile.top_kernels(prof, dev)
    res.setdefault("census", {})[f"prefill {a.prefill[0]}"] = profile.kernel_census(prof)
    res.setdefault("copy_sites", {})[f"prefill {a.prefill[0]}"] = profile.copy_sites(prof)
    for ctx in a.ctx:
        for b in a.batches:
            rids = tandem_bench.fill_decode_batch(eng, ctx, b)
            experts = tandem_bench.experts_touched(eng)
            t, _ = tandem_bench.decode_steps(eng, a.decode_steps)
            by = costs.decode_bytes(cfg, eng.model, b, ctx, experts, eng.dtype.itemsize)
            row = {"ctx": ctx, "batch": b, "step_seconds": t, "bytes": by, "experts_touched": experts}
            row["bytes_per_s"] = by["total"] / t
            row["roofline"] = row["bytes_per_s"] / bw
            res["decode"].append(row)
            print(f"tandem decode ctx {ctx} batch {b}: {t * 1e3:.2f} ms/step", flush=True)
            if ctx == a.ctx[0] and b == max(a.batches):
                _overhead(a, eng, res, ctx, b, t)
            elif b in (a.profile_batches or ()) and ctx == a.ctx[0]:
                _profile_decode(eng, res, ctx, b)
            tandem_bench.clear(eng, rids)


def run_prefill_graphs(a: argparse.Namespace, eng: LLMEngine, res: dict[str, Any]) -> None:
    """The prefill lengths again through the piecewise graphs (engine/prefill_graph), on the same engine: time,
    MFU, speedup over the eager rows above, the first token's logits against the eager step's, and the kernel
    census of one step (same kernels, fewer launches from the host)."""
    pg = getattr(eng.runner, "prefill_graphs", None)
    if pg is None:
        res["notes"].append("prefill graphs: this engine has none (cuda_graphs off or prefill_graph_max_tokens 0)")
        return
    eager = {p["length"]: p for p in res["prefill"]}
    peak = res["ceilings"]["matmul"]["flops_per_s"]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    lengths = [n for n in a.prefill if n <= pg.buckets[-1]]
    for length in lengths:
        ids = tandem_bench.prompt(length, eng.model_config.vocab_size, length)
        logits = {}
        for on in (False, True):
            pg.enabled = on
            with tandem_bench.first_logits(eng) as seen:
                eng.generate([ids], one)  # with graphs: captures this bucket
            logits[on] = seen[0]
        # the KDA cores eager between the pieces, then (the default) inside them once the layout repeats
        # (engine/prefill_graph/layouts.py): the prefill_seconds warm-up is the layout's second sighting
        layouts_on = pg.layouts.enabled
        pg.layouts.enabled = False
        t_pieces, _ = tandem_bench.prefill_seconds(eng, ids, a.repeat)
        pg.layouts.enabled = layouts_on
        t, _ = tandem_bench.prefill_seconds(eng, ids, a.repeat)
        with tandem_bench.first_logits(eng) as seen:
            before = pg.counts["layout_steps"]
            eng.generate([ids], one)
        layout_step = pg.counts["layout_steps"] > before
        fl = costs.prefill_flops(eng.model_config, length)
        diff = (logits[True] - logits[False]).abs().max().item()
        same = bool((logits[True].argmax(-1) == logits[False].argmax(-1)).all())
        row = {"length": length, "seconds": t, "tokens_per_s": length / t, "mfu": fl["total"] / t / peak}
        row.update(eager_seconds=eager[length]["seconds"], max_abs_logit_diff=diff, argmax_equal=same)
        row.update(
            pieces_seconds=t_pieces,
            pieces_mfu=fl["total"] / t_pieces / peak,
            layout_step=layout_step,
            layout_max_abs_logit_diff=(seen[0] - logits[False]).abs().max().item(),
        )
        if length == lengths[-1]:  # the longest: where the kernels, not the launches, should set the time
            with profile.labelled_ops(eng.model):
                prof = profile.profiled(lambda ids=ids: eng.generate([ids], one), eng.device)
            row["census"] = profile.kernel_census(prof)
        res.setdefault("prefill_graphs", []).append(row)
        print(
            f"tandem prefill {length} (piecewise graphs): {t * 1e3:.1f} ms (KDA cores in the graphs: "
            f"{layout_step}; eager between the pieces {t_pieces * 1e3:.1f} ms) vs eager "
            f"{row['eager_seconds'] * 1e3:.1f} ms, MFU {row['mfu']:.1%}, logits max diff {diff:.3g} (layout graphs "
            f"{row['layout_max_abs_logit_diff']:.3g}), argmax equal {same}",
            flush=True,
        )
    res["prefill_graph_stats"] = pg.stats()


def _overhead(a: argparse.Namespace, eng: LLMEngine, res: dict[str, Any], ctx: int, b: int, wall: float) -> None:
    """Profile a few decode steps of the running batch: op breakdown and host overhead per step."""
    bd = _profile_decode(eng, res, ctx, b)
    gpu_ms, wall_ms = bd["total"], wall * 1e3
    res["overhead"] = {
        "batch": b,
        "ctx": ctx,
        "wall_ms": wall_ms,
        "gpu_ms": gpu_ms,
        "overhead_ms": wall_ms - gpu_ms,
        "overhead_fraction": (wall_ms - gpu_ms) / gpu_ms if gpu_ms else None,
    }


def _profile_decode(eng: LLMEngine, res: dict[str, Any], ctx: int, b: int, n: int = 5) -> dict[str, float]:
    """Op breakdown, top kernels, kernel census and copy sites of n eager decode steps of the running batch."""
    with profile.labelled_ops(eng.model):
        prof = profile.profiled(lambda: [eng.step() for _ in range(n)], eng.device, stacks=True)
    bd = profile.breakdown(prof, eng.device, per=n)
    res["breakdown"][f"decode step b={b} ctx={ctx}"] = bd
    res["top_kernels"][f"decode b={b} ctx={ctx}"] = profile.top_kernels(prof, eng.device)
    res.setdefault("census", {})[f"decode b={b} ctx={ctx}"] = profile.kernel_census(prof, per=n)
    res.setdefault("copy_sites", {})[f"decode b={b} ctx={ctx}"] = profile.copy_sites(prof, per=n)
    return bd


def run_graphs(a: argparse.Namespace, eng: LLMEngine, res: dict[str, Any]) -> None:
    """Eager vs graph vs overlapped-graph decode on the same engine and the same filled batches."""
    graphs = getattr(eng.runner, "decode_graphs", None)
    if graphs is None:
        res["notes"].append("decode graphs: this engine has none (EngineConfig.cuda_graphs off or unsupported)")
        return
    if eng.device.type != "cuda":
        res["notes"].append("host run: the 'graph' columns are the padded static-buffer path run eagerly")
    overlap = getattr(eng, "overlap", None)
    modes = ("eager", "graph", "async") if overlap is not None else ("eager", "graph")
    for ctx in a.ctx:
        for b in a.batches:
            row: dict[str, Any] = {"ctx": ctx, "batch": b}
            toks, first = {}, {}
            for mode in modes:
                graphs.enabled = mode != "eager"
                eng.overlap = overlap if mode == "async" else None
                rids = tandem_bench.fill_decode_batch(eng, ctx, b)
                with tandem_bench.first_logits(eng) as seen:  # the first decode step, from the same state
                    times = tandem_bench.decode_steps_timed(eng, a.decode_steps)
                    toks[mode] = times.tokens
                if seen:
                    first[mode] = seen[0]
                row[f"{mode}_ms"] = times.mean * 1e3
                row[f"{mode}_median_ms"] = times.median * 1e3  # steady state: no idle start, no drain
                if mode == "async" and (b == max(a.batches) or b in (a.profile_batches or ())):
                    row["replay_ms"] = _replay_ms(graphs, eng.device, b)
                tandem_bench.clear(eng, rids)
                tandem_bench.drain(eng)
            # tokens can part on a near-tie (bf16 sums in another order); the first step's logits say whether
            # the two paths compute the same function: their gap against the top-1/top-2 margin
            diff = (first["eager"] - first["graph"]).abs().max().item()
            top2 = first["eager"].topk(2, dim=-1).values
            row["first_step_logits"] = {
                "max_abs_diff": diff,
                "max_abs_logit": first["eager"].abs().max().item(),
                "min_top2_gap": (top2[:, 0] - top2[:, 1]).min().item(),
                "argmax_equal": (first["eager"].argmax(-1) == first["graph"].argmax(-1)).float().mean().item(),
            }
            for other in modes[1:]:
                key = "token_agreement" if other == "graph" else f"token_agreement_{other}"
                row[key] = _agreement(toks["eager"], toks[other])
            if "async" in toks:  # the same kernels on the same batches: anything but 100 % is a bug
                row["token_agreement_async_vs_graph"] = _agreement(toks["graph"], toks["async"])
            row["graph_stats"] = graphs.stats()
            if overlap is not None:
                row["overlap_stats"] = dict(overlap.counts)
            res["graphs"].append(row)
            o = res.get("overhead")
            if o and (o["ctx"], o["batch"]) == (ctx, b):  # same kernels: graph wall - eager kernel time
                for mode in modes[1:]:
                    over = row[f"{mode}_ms"] - o["gpu_ms"]
                    key = "overhead_graph" if mode == "graph" else f"overhead_{mode}"
                    res[key] = {**o, "wall_ms": row[f"{mode}_ms"], "overhead_ms": over}
                    res[key]["overhead_fraction"] = over / o["gpu_ms"] if o["gpu_ms"] else None
                    if row.get("replay_ms"):  # against the graph's own GPU time, gaps between kernels included
                        res[key]["replay_ms"] = row["replay_ms"]
                        res[key]["overhead_vs_replay"] = (row[f"{mode}_ms"] - row["replay_ms"]) / row["replay_ms"]
            print(
                f"graphs ctx {ctx} batch {b}: " + ", ".join(f"{m} {row[f'{m}_ms']:.2f} ms" for m in modes),
                flush=True,
            )
    graphs.enabled = True
    eng.overlap = overlap


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of equal tokens, step by step and row by row."""
    pairs = [(x, y) for s, r in zip(a, b, strict=True) for x, y in zip(s, r, strict=True)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def _replay_ms(graphs: Any, device: torch.device, batch: int, n: int = 20) -> float | None:
    """Back-to-back replays of the running batch's captured graph (the largest context bucket captured for
    its padded size): the step's GPU time with no host in between (rewrites the running batch's newest KV row
    and advances its KDA state: timing only, the batch is cleared after)."""
    keys = [k for k in graphs._graphs if k[0] >= batch]
    if not keys:
        return None
    bs = min(k[0] for k in keys)
    graph = graphs._graphs[max(k for k in keys if k[0] == bs)][0]
    graph.replay()
    tandem_bench.sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        graph.replay()
    tandem_bench.sync(device)
    return (time.perf_counter() - t0) / n * 1e3


def run_hf(a: argparse.Namespace, res: dict[str, Any], device: torch.device, dtype: torch.dtype) -> None:
    """HF workloads into res['hf'] = {'prefill': {length: ...}, 'decode': {'ctx,batch': ...}}."""
    if device.type != "cuda":
        hf_bench.block_fla()
    hf: dict[str, Any] = {"prefill": {}, "decode": {}}
    res["hf"] = hf
    loaded = hf_bench.guarded(lambda: {"model": hf_bench.load_hf(str(a.model_dir), dtype, device)}, device)
    if "error" in loaded:
        res["notes"].append(f"HF model did not load: {loaded['error']}")
        return
    model = loaded["model"]
    vocab = model.config.vocab_size
    for length in a.prefill:
        ids = tandem_bench.prompt(length, vocab, length)
        hf["prefill"][str(length)] = r = hf_bench.guarded(
            lambda ids=ids: hf_bench.hf_prefill(model, ids, a.repeat, device), device
        )
        print(f"hf prefill {length}: {r}", flush=True)
    for ctx in a.ctx:
        for b in a.batches:
            key = f"{ctx},{b}"
            if b * ctx > a.hf_max_decode_tokens:
                hf["decode"][key] = {"error": f"skipped: batch x ctx > --hf-max-decode-tokens {a.hf_max_decode_tokens}"}
                continue
            ids = tandem_bench.prompt(ctx, vocab, 7)
            hf["decode"][key] = r = hf_bench.guarded(
                lambda ids=ids, b=b: hf_bench.hf_decode(model, ids, b, a.hf_decode_steps, device), device
            )
            print(f"hf decode ctx {ctx} batch {b}: {r}", flush=True)


def merge(files: list[Path]) -> dict[str, Any]:
    """One result from a Tandem-only and an HF-only run (same GPU, two processes)."""
    out: dict[str, Any] = {}
    for f in files:
        r = json.loads(f.read_text())
        for k, v in r.items():
            if isinstance(v, list) and out.get(k):
                out[k] = out[k] + v
            elif isinstance(v, dict) and out.get(k):
                out[k] = {**out[k], **v}
            elif v or k not in out:
                out[k] = v
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_mid", description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=None, help="checkpoint dir (written if absent)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (host verification)")
    p.add_argument("--prefill", type=int, nargs="*", default=None)
    p.add_argument("--ctx", type=int, nargs="*", default=None)
    p.add_argument("--batches", type=int, nargs="*", default=None)
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument(
        "--profile-batches",
        type=int,
        nargs="*",
        default=None,
        help="decode batches (at the first --ctx) also profiled op by op, with their graphs' back-to-back replay time",
    )
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--kv-gib", type=float, default=16.0, help="KV + KDA state budget on the GPU")
    p.add_argument("--page-size", type=int, default=None, help="KV page size (default: EngineConfig's)")
    p.add_argument("--parts", nargs="*", default=["tandem", "hf"], choices=("tandem", "hf"))
    p.add_argument("--merge", type=Path, nargs="*", default=None, help="only render these result JSONs as one")
    p.add_argument("--hf-decode-steps", type=int, default=5)
    p.add_argument("--hf-max-decode-tokens", type=int, default=1 << 21)
    p.add_argument("--no-graphs", action="store_true", help="skip the eager-vs-graph decode comparison")
    p.add_argument("--moe-prefill-ab", action="store_true", help="MoE prefill kernels off / on, interleaved (eager)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"), help="default: bf16 on CUDA")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.merge:
        print(render(merge(a.merge)))
        return 0
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    _defaults(a, cuda)
    a.model_dir = a.model_dir or Path(f"/tmp/tandem-mid-kimi-{a.layers}l{'-tiny' if a.tiny else ''}")
    dtype_name = a.dtype or ("bfloat16" if cuda else "float32")
    t0 = time.perf_counter()
    write_mid_model(a.model_dir, MidSpec("kimi_linear", a.layers, a.tiny))
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "model": f"Kimi-Linear {'tiny' if a.tiny else 'mid'} shape, {a.layers} layers, {dtype_name}",
        "args": {k: str(v) for k, v in vars(a).items()},
        "notes": [f"checkpoint ready in {time.perf_counter() - t0:.0f} s ({a.model_dir})"],
        "prefill": [],
        "decode": [],
        "breakdown": {},
        "top_kernels": {},
        "graphs": [],
        "hf": {},
        "ceilings": {"matmul": roofline.matmul_peak_flops(device), "copy": roofline.copy_bandwidth(device)},
    }
    if not cuda:
        res["notes"].append("host run: ceilings, MFU and roofline ratios are CPU numbers, only the plumbing is checked")
    if "tandem" in a.parts:
        graphs = {"cuda_graphs": not a.no_graphs, "async_scheduling": not a.no_graphs} if _has_graph_flag() else {}
        eng = _engine(a, device.type, dtype_name, **graphs)
        run_tandem(a, eng, res)
        _save(a.out, res)
        if a.moe_prefill_ab:
            run_moe_prefill_ab(a, eng, res)
            _save(a.out, res)
        run_prefill_graphs(a, eng, res)
        _save(a.out, res)
        if not a.no_graphs:
            run_graphs(a, eng, res)
        del eng
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        _save(a.out, res)
    if "hf" in a.parts:
        run_hf(a, res, device, getattr(torch, dtype_name))
        _save(a.out, res)
    text = render(res)
    print(text)
    for name, table in res["top_kernels"].items():
        print(f"\n### top ops: {name}\n{table}")
    _save(a.out, res)
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


def _save(path: Path | None, res: dict[str, Any]) -> None:
    """Written after each part too, so a run cut by the time limit still leaves its numbers."""
    if path is not None:
        path.write_text(json.dumps(res, indent=1, default=str))


def _has_graph_flag() -> bool:
    return "cuda_graphs" in EngineConfig.__dataclass_fields__


if __name__ == "__main__":
    raise SystemExit(main())
