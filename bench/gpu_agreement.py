"""GPU engine (bf16, fast kernels) vs the CPU fp32 reference path and vs HF transformers on the GPU:
top-1 agreement over >= 2k generated tokens, teacher-forced on the reference continuation (so one
early near-tie does not cascade into the rest of the comparison).

    python -m bench.gpu_agreement [--prompts 32] [--tokens 64]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tiny_model import make_tiny_model


def agreement(arch: str, n_prompts: int, n_tokens: int, dtype: str = "bfloat16") -> dict[str, float]:
    model = str(make_tiny_model(Path(tempfile.mkdtemp()) / arch, arch=arch))
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(4, 500, (int(torch.randint(8, 200, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n_prompts)
    ]
    cpu = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", cpu_threads=8))
    ref = cpu.generate(prompts, SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True))
    gpu = LLMEngine(EngineConfig(model=model, device="cuda", dtype=dtype, kv_cache_memory_bytes=2 << 30))
    gpu_free = gpu.generate(prompts, SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).cuda().eval()
    agree_cpu = agree_hf = total = free_equal = 0
    for p, r, fr in zip(prompts, ref, gpu_free, strict=True):
        seq = p + r.output_token_ids
        ours = gpu.prompt_logits(seq[:-1])[len(p) - 1 :].argmax(-1).cpu()
        with torch.no_grad():
            theirs = hf(torch.tensor([seq[:-1]], device="cuda")).logits[0, len(p) - 1 :].argmax(-1).cpu()
        want = torch.tensor(r.output_token_ids)
        agree_cpu += int((ours == want).sum())
        agree_hf += int((ours == theirs).sum())
        total += len(want)
        free_equal += int(fr.output_token_ids == r.output_token_ids)
    return {
        "tokens": total,
        "gpu_vs_cpu_fp32_top1": agree_cpu / total,
        "gpu_vs_hf_gpu_top1": agree_hf / total,
        "free_running_sequences_identical": free_equal / n_prompts,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    for arch in ("kimi_linear", "qwen3"):
        r = agreement(arch, a.prompts, a.tokens, a.dtype)
        print(
            f"{arch} {a.dtype}: "
            + ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
