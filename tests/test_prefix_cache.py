"""Device-resident prefix cache: hits reuse pages and KDA checkpoints, tokens never change."""

from __future__ import annotations

import pytest
import torch

from engine.block_hash import block_hashes, namespace
from engine.sampling_params import SamplingParams
from tests.conftest import make_engine, random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PS = 16  # page size; rungs every 4 pages = 64 tokens


def _run(engine, prompts):
    return [o.output_token_ids for o in engine.generate(prompts, GREEDY)]


@pytest.mark.parametrize(("budget", "page_size"), [(1024, 16), (40, 16), (1024, 64), (40, 64)])
def test_shared_prefix_hits_and_tokens_equal_uncached(model_dir, arch, budget, page_size):
    """Pages of 16 (rungs every 4 pages) and of 64 (the GPU decode's FlashMLA pages; rungs every page): rungs
    at 64-token multiples either way, so the same prompts cross them."""
    base = random_prompts(1, [200], seed=5)[0]
    prompts = [
        base,
        base[:150] + random_prompts(1, [30], seed=6)[0],  # match ends between rungs (150 -> pages 9)
        base[:129] + [7, 8, 9],  # rung 128 + 1: the resumed chunk starts one token after a rung
        base,  # the whole prompt again
        base[:65],  # rung + 1 (64): the fork lands on a one-token first step
    ]
    paging = {"page_size": page_size, "kda_checkpoint_pages": 64 // page_size}
    cold = make_engine(model_dir, max_num_batched_tokens=budget, **paging)
    want = [_run(cold, [p])[0] for p in prompts]
    warm = make_engine(model_dir, max_num_batched_tokens=budget, enable_prefix_caching=True, **paging)
    got = [_run(warm, [p])[0] for p in prompts]
    assert got == want
    assert warm.prefix_cache.hit_tokens > 0


def test_hit_lengths_and_rung_fallback(tiny_models):
    engine = make_engine(tiny_models["kimi_linear"], enable_prefix_caching=True, max_num_batched_tokens=4096)
    base = random_prompts(1, [300], seed=7)[0]
    engine.generate([base], GREEDY)
    req_of = {}
    for name, prompt in {"between": base[:150] + [5, 6], "rung": base[:192] + [5], "whole": base + [9]}.items():
        rid = engine.add_request(prompt, GREEDY)
        req_of[name] = engine._requests[rid]
        req = req_of[name]
        sched = engine.scheduler.schedule()
        chunk = next(c for c in sched.chunks if c.request is req)
        req_of[name] = (req.prefix_hit_tokens, chunk.start)
        engine.abort_request(rid)
        engine.scheduler.postprocess(sched, {})  # nothing ran; the aborted request is skipped
    # KV pages hit up to the match; KDA resumes at the last rung (64-token multiples) below it
    assert req_of["between"] == (144, 128)
    assert req_of["rung"] == (192, 192)
    assert req_of["whole"] == (288, 256)


def test_rung_checkpoint_equals_token_by_token_state(tiny_models):
    prompt = random_prompts(1, [140], seed=8)[0]
    engine = make_engine(tiny_models["kimi_linear"], enable_prefix_caching=True, max_num_batched_tokens=100)
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    ref = make_engine(tiny_models["kimi_linear"], max_num_batched_tokens=1)
    rid = ref.add_request(prompt[:128], SamplingParams(max_tokens=2, temperature=0))
    while ref._requests[rid].num_computed_tokens < 128:
        ref.step()
    ref_slot = ref._requests[rid].slot_ids[0]
    hashes = block_hashes(namespace(engine.namespace_digest, ""), prompt, PS)
    for rung in (64, 128):
        slot = engine.slots.lookup(hashes[rung // PS - 1])
        assert slot is not None, f"no checkpoint at rung {rung}"
        if rung == 128:
            for layer in engine.cache.recurrent:
                torch.testing.assert_close(engine.cache.recurrent[layer][slot], ref.cache.recurrent[layer][ref_slot])
                torch.testing.assert_close(engine.cache.conv[layer][slot], ref.cache.conv[layer][ref_slot])


def test_salt_separates_namespaces(tiny_models):
    engine = make_engine(tiny_models["qwen3"], enable_prefix_caching=True)
    prompt = random_prompts(1, [100], seed=9)[0]
    engine.add_request(prompt, GREEDY, cache_salt="tenant-a")
    while engine.has_unfinished_requests():
        engine.step()
    rid = engine.add_request(prompt, GREEDY, cache_salt="tenant-b")
    engine.step()
    assert engine._requests[rid].prefix_hit_tokens == 0


def test_eviction_under_a_small_pool_keeps_tokens_exact(arch, model_dir):
    prompts = random_prompts(12, [90, 130, 60], seed=10)
    prompts += [p[:70] + [11, 12] for p in prompts[:6]]
    cold = make_engine(model_dir)
    want = _run(cold, prompts)
    budget = {"kimi_linear": 360_000, "qwen3": 700_000}[arch]  # ~42 pages either way
    small = make_engine(
        model_dir,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=budget,
        max_model_len=400,
        max_num_seqs=4,
        num_checkpoint_slots=4,
    )
    got = _run(small, prompts)
    assert got == want
    assert small.pages.num_evictions > 0
    assert small.pages.num_used == 0 and (small.slots is None or small.slots.num_used == 0)
