"""Prefix tier: TTFT cold vs warm when the hit comes from *another replica's* tier, and tier
store/load bandwidth vs a plain memcpy of the same bytes. Starts its own redis-server.

    python -m bench.prefix_tier [--arch kimi_linear] [--prompt-len 8192] [--cached 7168]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tiny_model import make_tiny_model
from kvstore.store import PrefixStore, PrefixStoreConfig
from kvstore.tier import LMCacheTier, TierConfig


def _redis() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}"


def _model(arch: str, max_len: int) -> str:
    d = Path(tempfile.mkdtemp()) / arch
    make_tiny_model(d, arch=arch)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_max_length" if arch == "kimi_linear" else "max_position_embeddings"] = max_len
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


async def _ttft(aengine: AsyncEngine, store: PrefixStore | None, prompt: list[int], rid: str) -> float:
    q = aengine.open_stream(rid)
    t0 = time.perf_counter()
    if store is not None:
        await store.load(aengine, prompt)
    await aengine.call(lambda e: e.add_request(prompt, SamplingParams(max_tokens=1, temperature=0), request_id=rid))
    await q.get()
    aengine.close_stream(rid)
    return time.perf_counter() - t0


async def ttft_bench(arch: str, prompt_len: int, cached: int, redis_url: str) -> dict[str, float]:
    model = _model(arch, prompt_len + 1024)
    loop = asyncio.get_running_loop()

    def replica(name: str, caching: bool):
        cfg = EngineConfig(
            model=model,
            dtype="float32",
            kv_cache_memory_bytes=512 << 20,
            max_num_batched_tokens=1024,
            enable_prefix_caching=caching,
        )
        engine = LLMEngine(cfg)
        cfgs = PrefixStoreConfig(redis_url=redis_url, instance_id=name)
        store = PrefixStore(cfgs, engine, "bench-model") if caching else None  # replicas share the model tag
        ae = AsyncEngine(engine, loop)
        ae.start()
        return ae, store

    g = torch.Generator().manual_seed(0)
    a = torch.randint(4, 500, (prompt_len,), generator=g).tolist()
    b = a[:cached] + torch.randint(4, 500, (prompt_len - cached,), generator=g).tolist()
    c = torch.randint(4, 500, (prompt_len,), generator=g).tolist()
    cold_ae, _ = replica("cold", False)
    await _ttft(cold_ae, None, c[:64], "warmup")
    cold = min([await _ttft(cold_ae, None, c, f"cold{i}") for i in range(2)])
    p1, s1 = replica("p1", True)
    p2, s2 = replica("p2", True)
    await _ttft(p1, s1, a, "fill")
    s1.flush(60)
    warm = await _ttft(p2, s2, b, "warm")
    hit = s2.counters["tier_hit_tokens"]
    for ae in (cold_ae, p1, p2):
        ae.stop()
    s1.close()
    s2.close()
    return {"cold_s": cold, "warm_s": warm, "ratio": warm / cold, "tier_hit_tokens": hit}


def bandwidth_bench(redis_url: str | None, total_mib: int, entry_kib: int) -> dict[str, float]:
    tier = LMCacheTier(TierConfig(local_cpu_bytes=(total_mib + 64) << 20, remote_url=redis_url), "bench")
    n = total_mib * 1024 // entry_kib
    blobs = [torch.randint(0, 255, (entry_kib * 1024,), dtype=torch.uint8).numpy().tobytes() for _ in range(n)]
    keys = [i.to_bytes(32, "big") for i in range(n)]
    t = time.perf_counter()
    for k, b in zip(keys, blobs, strict=True):
        tier.put(1, k, b)
    store_s = time.perf_counter() - t
    # load: a fresh tier (another replica) when there is a remote level, else this one's local CPU
    reader = (
        LMCacheTier(TierConfig(local_cpu_bytes=(total_mib + 64) << 20, remote_url=redis_url), "bench")
        if redis_url
        else tier
    )
    t = time.perf_counter()
    got = sum(reader.get(1, k) is not None for k in keys)
    load_s = time.perf_counter() - t
    assert got == n, f"only {got}/{n} entries came back"
    if reader is not tier:
        reader.close()
    src = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8)
    dst = torch.empty_like(src)
    t = time.perf_counter()
    dst.copy_(src)
    copy_s = time.perf_counter() - t
    tier.close()
    mib = n * entry_kib / 1024
    return {
        "store_MiB_s": mib / store_s,
        "load_MiB_s": mib / load_s,
        "memcpy_MiB_s": mib / copy_s,
        "store_vs_memcpy": copy_s / store_s,
        "load_vs_memcpy": copy_s / load_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="kimi_linear")
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--cached", type=int, default=7168)
    ap.add_argument("--tier-mib", type=int, default=64)
    ap.add_argument("--entry-kib", type=int, default=64)
    a = ap.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is needed")
    proc, url = _redis()
    try:
        r = asyncio.run(ttft_bench(a.arch, a.prompt_len, a.cached, url))
        print(f"TTFT {a.arch} prompt {a.prompt_len}, {a.cached} cached in another replica's tier (CPU, fp32):")
        print(f"  cold {r['cold_s']:.3f} s   warm {r['warm_s']:.3f} s   warm/cold {r['ratio']:.1%}")
        print(f"  tokens loaded from the tier: {r['tier_hit_tokens']:.0f}")
        for label, remote in (("local CPU", None), ("local CPU + Redis", url)):
            b = bandwidth_bench(remote, a.tier_mib, a.entry_kib)
            print(
                f"tier {label:>17}: store {b['store_MiB_s']:8.1f} MiB/s ({b['store_vs_memcpy']:.2%} of memcpy), "
                f"load {b['load_MiB_s']:8.1f} MiB/s ({b['load_vs_memcpy']:.2%}), memcpy {b['memcpy_MiB_s']:8.0f} MiB/s"
            )
    finally:
        proc.terminate()


if __name__ == "__main__":
    main()
