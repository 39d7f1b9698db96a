"""Our engine vs HF transformers on the same tiny checkpoint, fp32 on CPU.

transformers runs its pure-torch path (fla is blocked in conftest)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.sampling_params import SamplingParams
from tests.conftest import make_engine, random_prompts

LOGITS_ATOL = 1e-4  # measured max |diff| is ~1e-5 (see docs/ARCHITECTURE.md)


@pytest.fixture(scope="module")
def hf_models(tiny_models):
    models = {}
    for a, d in tiny_models.items():
        m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        # compare raw greedy argmax: no EOS stop (ours runs with ignore_eos) and no EOS suppression
        m.generation_config.eos_token_id = None
        models[a] = m
    return models


def test_prompt_logits_match_transformers(arch, model_dir, hf_models):
    engine = make_engine(model_dir)
    hf = hf_models[arch]
    for prompt in random_prompts(4, [1, 7, 64, 150], seed=1):
        ours = engine.prompt_logits(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        diff = (ours - ref).abs().max().item()
        assert diff < LOGITS_ATOL, f"{arch} len={len(prompt)} max|logit diff|={diff:.2e}"
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_generation_matches_transformers_generate(arch, model_dir, hf_models):
    """8 prompts of different lengths, 64 greedy tokens each, batched in our engine."""
    hf = hf_models[arch]
    prompts = random_prompts(8, [3, 9, 17, 30, 45, 64, 80, 100], seed=2)
    engine = make_engine(model_dir, max_num_batched_tokens=128)
    outs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=64,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert out.output_token_ids == ref, f"{arch} prompt len {len(prompt)} diverges"


def test_mla512_preset_in_pages_of_64_matches_transformers(tmp_path):
    """The checkpoint FlashMLA's GPU check runs (real MLA latent 512 + 64, pages of 64): on the CPU reference
    path, greedy tokens equal HF's, so a GPU disagreement there is the GPU's."""
    from engine.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "mla512", arch="kimi_linear", preset="mla512")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    prompts = random_prompts(3, [5, 70, 130], seed=3)
    engine = make_engine(model_dir, page_size=64, max_num_batched_tokens=128)
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert out.output_token_ids == ref[0, len(prompt) :].tolist(), f"prompt len {len(prompt)} diverges"
