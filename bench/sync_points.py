"""Where a step makes the host wait for the GPU: torch's sync debug mode over one prefill and a few decode steps.

    python -m bench.sync_points --model /tmp/tandem-mid-kimi-8l --prefill 8192 --out sync.json   # on the GPU

Every synchronising CUDA call (a device-to-host copy, ``.item()``, ``.tolist()``, a pageable host-to-device
copy, ``nonzero``) inside the profiled calls is recorded with the innermost frames of our own code that led
to it. A sync in the middle of a forward drains the GPU's queue: the GPU then idles while the host enqueues
the next kernels, which is where a prefill's wall time exceeds its kernel time.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from bench.mid import tandem_bench
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sync_census import sync_census


def census(fn) -> Counter:
    with sync_census() as seen:
        fn()
    return seen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prefill", type=int, default=8192)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    eng = LLMEngine(
        EngineConfig(
            model=a.model,
            dtype="bfloat16",
            max_num_seqs=max(a.batch, 2),
            max_num_batched_tokens=a.prefill,
            max_model_len=max(a.prefill, a.ctx) + 64,
            kv_cache_memory_bytes=8 << 30,
        )
    )
    vocab = eng.model_config.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    eng.generate([tandem_bench.prompt(a.prefill, vocab, 0)], one)  # compile + autotune outside the census
    res = {"prefill": census(lambda: eng.generate([tandem_bench.prompt(a.prefill, vocab, 1)], one))}
    rids = tandem_bench.fill_decode_batch(eng, a.ctx, a.batch)
    eng.step()
    res["decode (eager, 3 steps)"] = census(lambda: [eng.step() for _ in range(3)])
    tandem_bench.clear(eng, rids)
    for name, seen in res.items():
        print(f"== {name}: {sum(seen.values())} synchronising calls")
        for where, n in seen.most_common(30):
            print(f"  {n:5d}  {where}")
    if a.out:
        a.out.write_text(json.dumps({k: v.most_common() for k, v in res.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
