"""What streaming a handoff costs the prefill: one prompt's prefill with no producer attached, with the
producer encoding inline (its copy to the host made inside the forward), and with its encoder thread
(the copy enqueued into pinned memory, encoding off the engine thread; engine/kv_transfer/producer.py).

    python -m bench.producer_overhead                         # GPU: the Kimi-Linear mid checkpoint, bf16
    python -m bench.producer_overhead --tiny --prefill 2048   # host check: tiny shapes, fp32

The producer's messages go to a sink that counts them (no gRPC: bench/handoff.py measures the wire). Each
mode runs the same prompts, median of ``--repeat`` after a warm-up; the cost of a mode is its time minus
the no-producer time of the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.mid.checkpoint import MidSpec, write_mid_model
from engine.config import EngineConfig
from engine.kv_transfer.producer import HandoffProducer
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

MODES = ("no producer", "inline encode", "encoder thread")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def prefill_ms(eng: LLMEngine, prompt: list[int], mode: str, repeat: int) -> tuple[float, int]:
    """Median ms of a one-token prefill of ``prompt`` in ``mode``, and the payload bytes it streamed."""
    producer = None
    sent = [0]
    if mode != "no producer":
        producer = HandoffProducer(
            eng.model_config, eng.cache, eng.config.page_size, async_copies=mode == "encoder thread"
        )
        eng.model.layer_hooks.append(producer.on_layer)
        eng.before_output_hooks.append(producer.flush)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    try:
        for i in range(repeat + 1):
            rid = f"{mode}-{i}"
            if producer is not None:
                sent[0] = 0
                producer.register(rid, lambda chunk: sent.__setitem__(0, sent[0] + chunk.payload_bytes), 1 << 20)
            _sync(eng.device)
            t0 = time.perf_counter()
            eng.add_request(prompt, one, request_id=rid)
            while eng.has_unfinished_requests():
                eng.step()
            _sync(eng.device)
            if i:
                times.append((time.perf_counter() - t0) * 1e3)
            if producer is not None:
                producer.unregister(rid)
    finally:
        if producer is not None:
            eng.model.layer_hooks.remove(producer.on_layer)
            eng.before_output_hooks.remove(producer.flush)
    return statistics.median(times), sent[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (host check)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prefill", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--model-dir", type=Path, default=None)
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    model_dir = a.model_dir or Path(f"/tmp/tandem-mid-kimi-{a.layers}l{'-tiny' if a.tiny else ''}")
    write_mid_model(model_dir, MidSpec("kimi_linear", a.layers, a.tiny))
    longest = max(a.prefill)
    eng = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device="cuda" if cuda else "cpu",
            dtype="bfloat16" if cuda else "float32",
            max_num_batched_tokens=longest,
            max_model_len=longest + 64,
            max_num_seqs=4,
        )
    )
    g = torch.Generator().manual_seed(0)
    warm = torch.randint(4, eng.model_config.vocab_size, (longest,), generator=g).tolist()
    prefill_ms(eng, warm, "encoder thread", 1)  # kernels compiled / autotuned for every mode's shapes
    print("| prompt | mode | prefill ms | vs no producer | MiB streamed |\n|---|---|---|---|---|")
    for n in a.prefill:
        prompt = torch.randint(4, eng.model_config.vocab_size, (n,), generator=g).tolist()
        base = None
        for mode in MODES:
            ms, nbytes = prefill_ms(eng, prompt, mode, a.repeat)
            base = ms if base is None else base
            extra = "-" if mode == MODES[0] else f"{ms - base:+.1f} ms ({100 * (ms - base) / base:+.0f} %)"
            print(f"| {n} | {mode} | {ms:.1f} | {extra} | {nbytes / (1 << 20):.0f} |", flush=True)


if __name__ == "__main__":
    main()
