"""Decode tokens/s with and without speculation (n-gram on repetitive text; aux-tap with a tiny
random drafter as a worst case), measured in the same run.

    python -m bench.speculative [--model DIR] [--device cpu|cuda] [--k 3] [--batch 4] [--output-len 128]
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.config import EngineConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tiny_model import make_tiny_model


def _repetitive_prompts(engine: LLMEngine, batch: int) -> list[list[int]]:
    text = "the cat sat on the mat and the dog sat on the log. " * 12
    ids = engine.tokenizer.encode(text)
    return [ids[i:] for i in range(batch)]


def _decode_rate(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    for p in prompts:
        engine.add_request(p, params)
    tokens, secs, drafted, accepted = 0, 0.0, 0, 0
    while engine.has_unfinished_requests():
        prefilling = any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running)
        before = sum(len(r.output_token_ids) for r in engine.scheduler.running)
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        after = sum(len(r.output_token_ids) for r in engine.scheduler.running) + sum(
            len(o.output_token_ids) for o in outs if o.finished
        )
        if not prefilling and not engine.scheduler.waiting:
            secs += dt
            tokens += after - before
        for o in outs:
            if o.finished:
                drafted += o.num_drafted
                accepted += o.num_accepted
    return tokens / secs if secs else 0.0, accepted / drafted if drafted else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=128)
    a = ap.parse_args()
    model = a.model or str(make_tiny_model("/tmp/tandem-bench-qwen3", arch="qwen3"))
    # an explicit cache size: the engines run one after another in this process, and a budget taken from
    # free device memory would count the previous engine's (not yet collected) cache as someone else's
    base = EngineConfig(
        model=model,
        device=a.device,
        dtype="float32" if a.device == "cpu" else "bfloat16",
        kv_cache_memory_bytes=1 << 30,
    )
    rows = []
    for name, spec in (("off", SpeculativeConfig()), (f"ngram k={a.k}", SpeculativeConfig("ngram", a.k))):
        engine = LLMEngine(EngineConfig(**{**base.__dict__, "speculative": spec}))
        rate, acc = _decode_rate(engine, _repetitive_prompts(engine, a.batch), a.output_len)
        rows.append((name, rate, acc))
        del engine
    print(f"model={model} device={a.device} torch={torch.__version__} batch={a.batch} output_len={a.output_len}")
    print(f"{'speculation':>14} {'decode tok/s':>13} {'acceptance':>11} {'speed-up':>9}")
    for name, rate, acc in rows:
        print(f"{name:>14} {rate:13.1f} {acc:11.2f} {rate / rows[0][1]:9.2f}x")


if __name__ == "__main__":
    main()
