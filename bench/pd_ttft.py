"""TTFT on CPU: P/D (a real LocalCluster: router + prefill + decode processes) vs the single-process engine.

python -m bench.pd_ttft [--lengths 1024 8192] [--archs kimi_linear qwen3] [--repeats 3]

For each tiny model (written into a temp dir with its length limit raised to 16384 so 8k prompts fit):

- single process: ``LLMEngine.generate(prompt, max_tokens=1, temperature 0)``, timed in this process.
- P/D: a streaming completion request (token-id prompt, temperature 0, max_tokens 2, ignore_eos) sent
  with aiohttp to the router; TTFT = time to the first SSE chunk with text (and, beside it, the time
  to the response headers, which the router sends once the first token reached it). Around each
  request the prefill (P) and decode (D) workers' /metrics are scraped:
  P ttft = P's time from the request to its sampled first token (the prefill compute);
  D transfer = D's handoff pull, from the Prefill call to the end marker (runs alongside P's compute);
  D ttft = D's time from the request to the first token inserted (reserve + pull + insert);
  bytes = handoff payload bytes.

Both sides use the same chunk (``--max-num-batched-tokens``) and ``--cpu-threads 1``. Each
measurement is a fresh random prompt (no prefix reuse), run ``repeats`` times after a warm-up;
the tables show medians. The engine is timed while no cluster runs; during P/D the router, P and D
processes share the machine's cores.

``--tuned-malloc`` re-runs this command with glibc malloc tuned for every process (this one, the
router and both workers): MALLOC_MMAP_THRESHOLD_=1 GiB, MALLOC_TRIM_THRESHOLD_=1 GiB,
MALLOC_ARENA_MAX=1, so large temporaries are reused from the heap rather than mmapped, zero-filled
page by page and unmapped again at every step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

LIMIT_KEY = {"kimi_linear": "model_max_length", "qwen3": "max_position_embeddings"}
MAX_LEN = 16384
TUNED_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
    "MALLOC_ARENA_MAX": "1",
}
METRICS = {
    "p_ttft": "tandem_prefill_ttft_seconds_sum",
    "p_transfer": "tandem_prefill_transfer_seconds_sum",
    "d_transfer": "tandem_decode_transfer_seconds_sum",
    "d_ttft": "tandem_decode_ttft_seconds_sum",
    "bytes": "tandem_decode_transfer_bytes_total",
}


def prepare_model(arch: str, root: Path, max_len: int = MAX_LEN) -> Path:
    """The tiny model of ``arch`` in root/arch, its length limit raised to max_len."""
    from engine.tiny_model import make_tiny_model

    d = make_tiny_model(root / f"tiny-{arch}", arch=arch, seed=0)
    for name, key in (("config.json", LIMIT_KEY[arch]), ("tokenizer_config.json", "model_max_length")):
        cfg = json.loads((d / name).read_text())
        cfg[key] = max_len
        (d / name).write_text(json.dumps(cfg, indent=2) + "\n")
    return d


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g).tolist()


def scrape(port: int) -> dict[str, float]:
    """A worker's /metrics as {name: value} (the parser of tests/e2e/helpers.py)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) ([-+\d.eE]+|NaN)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---- single process ------------------------------------------------------------------------------


def single_ttft(model: Path, lengths: list[int], repeats: int, chunk: int, seed: int) -> dict[int, float]:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(str(model), max_num_batched_tokens=chunk, cpu_threads=1))
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0)
    out = {}
    for n in lengths:
        engine.generate([random_prompt(n, vocab, seed)], params)  # warm-up
        times = []
        for i in range(repeats):
            prompt = random_prompt(n, vocab, seed + 1 + i)
            t0 = time.perf_counter()
            engine.generate([prompt], params)
            times.append(time.perf_counter() - t0)
        out[n] = _median(times)
        print(f"  single process, {n} tokens: {[round(t, 3) for t in times]} s", flush=True)
    del engine
    return out


# ---- P/D -----------------------------------------------------------------------------------------


async def stream_ttft(session, url: str, model_name: str, prompt: list[int]) -> tuple[float, float]:
    """(seconds to the response headers, seconds to the first chunk with text) of one streaming request."""
    body = {
        "model": model_name,
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    t_first = None
    async with session.post(f"{url}/completions", json=body) as resp:
        t_headers = time.perf_counter() - t0
        if resp.status != 200:
            raise RuntimeError(f"router answered {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            choices = obj.get("choices") or []
            if t_first is None and choices and choices[0].get("text"):
                t_first = time.perf_counter() - t0
    return t_headers, t_first if t_first is not None else float("nan")


async def _pd_requests(cluster, model_name: str, lengths: list[int], repeats: int, vocab: int, seed: int) -> dict:
    import aiohttp

    p_port = cluster.worker("prefill").metrics_port
    d_port = cluster.worker("decode").metrics_port
    out = {}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for n in lengths:
            await stream_ttft(session, cluster.base_url, model_name, random_prompt(n, vocab, seed))  # warm-up
            rows = []
            for i in range(repeats):
                prompt = random_prompt(n, vocab, seed + 1 + i)
                before = {**scrape(p_port), **scrape(d_port)}
                t_headers, t_first = await stream_ttft(session, cluster.base_url, model_name, prompt)
                after = {**scrape(p_port), **scrape(d_port)}
                row = {"ttft": t_first, "headers": t_headers}
                row.update({k: after.get(name, 0.0) - before.get(name, 0.0) for k, name in METRICS.items()})
                rows.append(row)
            out[n] = {k: _median([r[k] for r in rows]) for k in rows[0]}
            print(f"  P/D, {n} tokens: TTFT {[round(r['ttft'], 3) for r in rows]} s", flush=True)
    return out


def pd_ttft(
    model: Path, lengths: list[int], repeats: int, chunk: int, seed: int, log_dir: Path, transport: str = "grpc"
) -> dict[int, dict[str, float]]:
    from engine.model_config import load_model_config
    from tandem.cluster import LocalCluster, WorkerSpec

    args = ["--max-num-batched-tokens", str(chunk), "--cpu-threads", "1"]
    p_args, d_args = list(args), list(args)
    if transport == "socket":  # the handoff's kv / state on the prefill worker's socket data plane
        p_args += ["--handoff-data-port", "0"]
        d_args += ["--handoff-transport", "socket"]
    cluster = LocalCluster(model, [WorkerSpec("prefill", p_args), WorkerSpec("decode", d_args)], log_dir=log_dir)
    t0 = time.perf_counter()
    cluster.start()
    print(f"  cluster up in {time.perf_counter() - t0:.1f} s (logs in {log_dir})", flush=True)
    try:
        vocab = load_model_config(str(model)).vocab_size
        return asyncio.run(_pd_requests(cluster, model.resolve().name, lengths, repeats, vocab, seed))
    finally:
        cluster.stop()


# ---- main ----------------------------------------------------------------------------------------


def _malloc_tuned() -> bool:
    return all(os.environ.get(k) == v for k, v in TUNED_MALLOC_ENV.items())


def run_pd_ttft_bench(
    lengths: list[int],
    archs: list[str],
    repeats: int = 3,
    chunk: int = 2048,
    seed: int = 0,
    root: Path | None = None,
    transports: tuple[str, ...] = ("grpc",),
) -> dict:
    malloc = (
        "tuned (" + " ".join(f"{k}={v}" for k, v in TUNED_MALLOC_ENV.items()) + ")" if _malloc_tuned() else "default"
    )
    print(
        f"P/D TTFT bench: lengths {lengths}, chunk {chunk}, cpu-threads 1, median of {repeats} after a warm-up, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, glibc malloc {malloc}, "
        f"load average {os.getloadavg()[0]:.1f} at start",
        flush=True,
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="tandem-pd-ttft-") as tmp:
        base = root or Path(tmp)
        for arch in archs:
            model = prepare_model(arch, base)
            print(f"{arch}: model in {model}", flush=True)
            single = single_ttft(model, lengths, repeats, chunk, seed)
            results[arch] = {"single": single}
            for t in transports:
                results[arch][t] = pd_ttft(model, lengths, repeats, chunk, seed + 100, base / f"logs-{arch}-{t}", t)

    print(
        "\n| model | handoff | prompt | single-process TTFT | P/D TTFT (first text chunk) | P/D / single "
        "| router headers | P ttft (prefill) | D transfer (pull) | D ttft | handoff MB | P/D − P ttft |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for arch, r in results.items():
        for t, n in ((t, n) for t in transports for n in lengths):
            s, p = r["single"][n], r[t][n]
            print(
                f"| {arch} | {t} | {n} | {1e3 * s:.0f} ms | {1e3 * p['ttft']:.0f} ms | {p['ttft'] / s:.2f}x "
                f"| {1e3 * p['headers']:.0f} ms | {1e3 * p['p_ttft']:.0f} ms | {1e3 * p['d_transfer']:.0f} ms "
                f"| {1e3 * p['d_ttft']:.0f} ms | {p['bytes'] / 1e6:.2f} | {1e3 * (p['ttft'] - p['p_ttft']):.0f} ms |",
                flush=True,
            )
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end", flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--archs", nargs="+", default=["kimi_linear", "qwen3"], choices=sorted(LIMIT_KEY))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="chunk size of both sides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tuned-malloc", action="store_true", help="glibc malloc tuned in every process (re-executes)")
    p.add_argument(
        "--handoff-transport", nargs="+", default=["grpc"], choices=["grpc", "socket"], help="a P/D run per transport"
    )
    a = p.parse_args(argv)
    if max(a.lengths) + 2 > MAX_LEN:
        p.error(f"lengths must be at most {MAX_LEN - 2}")
    if a.tuned_malloc and not _malloc_tuned():  # glibc reads these once, at process start
        args = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, "-m", "bench.pd_ttft", *args], {**os.environ, **TUNED_MALLOC_ENV})
    run_pd_ttft_bench(
        a.lengths, a.archs, a.repeats, a.max_num_batched_tokens, a.seed, transports=tuple(a.handoff_transport)
    )


if __name__ == "__main__":
    main()
