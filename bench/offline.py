"""Offline throughput: prefill tokens/s and decode tokens/s of the engine (one device, or --pcp/--pp/--tp ranks).

tandem bench offline --model DIR --batch 16 --prompt-len 256 --output-len 64
"""

from __future__ import annotations

import time

import torch

from engine.config import EngineConfig
from engine.parallel import create_engine
from engine.sampling_params import SamplingParams


def run_offline_bench(config: EngineConfig, batch: int, prompt_len: int, output_len: int) -> dict[str, float]:
    engine = create_engine(config)
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    engine.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0))  # warm-up

    # prefill: every request samples one token and stops
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    prefill_s = time.perf_counter() - t0

    # decode: time the steps after every request has finished its prefill
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    decode_tokens, decode_s = 0, 0.0
    while engine.has_unfinished_requests():
        prefilling = any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running) or bool(
            engine.scheduler.waiting
        )
        t = time.perf_counter()
        outs = engine.step()
        if not prefilling:
            decode_s += time.perf_counter() - t
            decode_tokens += len(outs)
    result = {
        "prefill_tokens_per_s": batch * prompt_len / prefill_s,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s else 0.0,
        "decode_step_ms": 1e3 * decode_s / max(decode_tokens / batch, 1),
    }
    print(
        f"model={config.model} device={engine.device} dtype={engine.dtype} batch={batch} "
        f"prompt_len={prompt_len} output_len={output_len}"
    )
    for k, v in result.items():
        print(f"{k:>22}: {v:,.1f}")
    engine.close()
    return result
