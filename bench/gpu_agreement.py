"""GPU engine (bf16, fast kernels) vs the CPU fp32 reference path and vs HF transformers on the GPU:
top-1 agreement over >= 2k generated tokens, teacher-forced on the reference continuation (so one
early near-tie does not cascade into the rest of the comparison); and each GPU decode mode (eager, CUDA
graphs, graphs + overlapped scheduling) against the GPU's own prefill path on the sequence it generated
(the decode step and the prefill must pick the same token from the same prefix, short of near-ties).

    python -m bench.gpu_agreement [--prompts 32] [--tokens 64] [--dtype bfloat16] [--arch kimi_linear qwen3]
    python -m bench.gpu_agreement --arch kimi_linear --preset mla512 --page-size 64   # decode through FlashMLA
    python -m bench.gpu_agreement --arch kimi_linear --preset mla512 --prompts 16 --tokens 128 --one-at-a-time

--one-at-a-time generates each prompt alone, so every decode step has one row: the path of the one-row skinny GEMM
(engine/backends/dense.py); together, the batch decodes at as many rows as prompts (cuBLAS above one row).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from bench.mid.hf_bench import block_fla
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tiny_model import make_tiny_model

MODES = {"eager": {}, "graphs": {"cuda_graphs": True}, "overlapped": {"cuda_graphs": True, "async_scheduling": True}}


def _teacher_forced(eng: LLMEngine, prompt: list[int], out: list[int]) -> torch.Tensor:
    """The engine's prefill argmax at every generated position of prompt + out."""
    seq = prompt + out
    return eng.prompt_logits(seq[:-1])[len(prompt) - 1 :].argmax(-1).cpu()


def agreement(
    arch: str,
    n_prompts: int,
    n_tokens: int,
    dtype: str = "bfloat16",
    device: str = "cuda",
    prompt_lens: tuple[int, int] = (8, 200),
    preset: str = "tiny",
    page_size: int | None = None,
    one_at_a_time: bool = False,
) -> dict[str, float]:
    model = str(make_tiny_model(Path(tempfile.mkdtemp()) / arch, arch=arch, preset=preset))
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(4, 500, (int(torch.randint(*prompt_lens, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n_prompts)
    ]
    greedy = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
    cpu = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", cpu_threads=8, page_size=page_size))
    ref = [r.output_token_ids for r in cpu.generate(prompts, greedy)]
    res: dict[str, float] = {}
    gpu = None
    for mode, flags in MODES.items():
        cfg = EngineConfig(
            model=model, device=device, dtype=dtype, kv_cache_memory_bytes=2 << 30, page_size=page_size, **flags
        )
        eng = LLMEngine(cfg)
        if one_at_a_time:
            outs = [eng.generate([p], greedy)[0].output_token_ids for p in prompts]
        else:
            outs = [r.output_token_ids for r in eng.generate(prompts, greedy)]
        # the decode path vs this engine's own prefill path on the same tokens
        same = sum(
            int((_teacher_forced(eng, p, o) == torch.tensor(o)).sum()) for p, o in zip(prompts, outs, strict=True)
        )
        res[f"{mode}_decode_vs_own_prefill_top1"] = same / sum(len(o) for o in outs)
        res[f"{mode}_free_running_sequences_equal_cpu_fp32"] = (
            sum(o == r for o, r in zip(outs, ref, strict=True)) / n_prompts
        )
        if mode == "eager":
            gpu = eng
        else:
            del eng
    if torch.device(device).type == "cpu":  # fla's Triton kernels, which transformers takes when it imports, need a GPU
        block_fla()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    agree_cpu = agree_hf = total = 0
    for p, r in zip(prompts, ref, strict=True):
        seq = p + r
        ours = gpu.prompt_logits(seq[:-1])[len(p) - 1 :].argmax(-1).cpu()
        with torch.no_grad():
            theirs = hf(torch.tensor([seq[:-1]], device=device)).logits[0, len(p) - 1 :].argmax(-1).cpu()
        agree_cpu += int((ours == torch.tensor(r)).sum())
        agree_hf += int((ours == theirs).sum())
        total += len(r)
    return {"tokens": total, "gpu_vs_cpu_fp32_top1": agree_cpu / total, "gpu_vs_hf_gpu_top1": agree_hf / total, **res}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda", help="cpu: a host check of the script itself")
    ap.add_argument("--arch", nargs="*", default=["kimi_linear", "qwen3"])
    ap.add_argument(
        "--prompt-lens", type=int, nargs=2, default=(8, 200), metavar=("LO", "HI"), help="prompt lengths in [LO, HI)"
    )
    ap.add_argument("--preset", default="tiny", help="engine/tiny_model.py preset (mla512: FlashMLA's MLA dims)")
    ap.add_argument("--page-size", type=int, default=None, help="default: EngineConfig's (64 on CUDA, 16 on CPU)")
    ap.add_argument("--one-at-a-time", action="store_true", help="decode each prompt alone (steps of one row)")
    a = ap.parse_args()
    for arch in a.arch:
        r = agreement(
            arch, a.prompts, a.tokens, a.dtype, a.device, tuple(a.prompt_lens), a.preset, a.page_size, a.one_at_a_time
        )
        alone = " one at a time" if a.one_at_a_time else ""
        print(
            f"{arch} {a.preset} page {a.page_size or 'default'} {a.dtype}{alone}: "
            + ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
