"""Engine invariants: chunking, batching, preemption and cache bookkeeping never change the tokens.

Every comparison is token-exact against a reference run of the same engine code with a different
schedule (one-shot prefill, a request alone, an unconstrained page pool), plus kernel-level checks
of the two KDA paths and the carried short-conv window.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from engine.cache.tensors import CacheLayout, state_bytes_per_slot
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams
from kernels.kda.naive import kda_gate, naive_chunk_kda, naive_recurrent_kda
from kernels.short_conv.naive import naive_short_conv
from tests.conftest import make_engine, random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT_LENS = [5, 37, 64, 90]


def _tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.output_token_ids for o in outs]


def _run_to_end(engine: LLMEngine) -> dict[str, RequestOutput]:
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _assert_all_freed(engine: LLMEngine) -> None:
    assert engine.pages.num_used == 0, f"{engine.pages.num_used} pages still held"
    if engine.slots is not None:
        assert engine.slots.num_used == 0, f"{engine.slots.num_used} KDA slots still held"
    assert not engine.scheduler.running and not engine.scheduler.waiting


# ---- chunked prefill ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_shot(tiny_models) -> dict[str, list[list[int]]]:
    """Greedy tokens with the whole batch prefilled in a single step."""
    prompts = random_prompts(4, PROMPT_LENS, seed=3)
    out = {}
    for a, d in tiny_models.items():
        eng = make_engine(d, max_num_batched_tokens=1024)
        out[a] = _tokens(eng.generate(prompts, GREEDY))
        assert [len(t) for t in out[a]] == [12] * 4
    return out


@pytest.mark.parametrize(("budget", "page_size"), [(7, 16), (16, 16), (33, 16), (1024, 16), (7, 5), (1, 16), (33, 64)])
def test_chunked_prefill_matches_one_shot(arch, model_dir, one_shot, budget, page_size):
    prompts = random_prompts(4, PROMPT_LENS, seed=3)
    eng = make_engine(model_dir, max_num_batched_tokens=budget, page_size=page_size)
    assert _tokens(eng.generate(prompts, GREEDY)) == one_shot[arch]
    _assert_all_freed(eng)


def test_chunked_prefill_really_chunks(model_dir):
    """Sanity of the setup above: a 90-token prompt with budget 7 needs ceil(90/7) prefill steps
    before its first token (chunks of 7 straddle the 16-token page boundaries)."""
    eng = make_engine(model_dir, max_num_batched_tokens=7)
    eng.add_request(random_prompts(1, [90], seed=4)[0], GREEDY)
    steps = 0
    while not eng.scheduler.running or not eng.scheduler.running[0].output_token_ids:
        sched_before = eng.scheduler.running[0].num_computed_tokens if eng.scheduler.running else 0
        eng.step()
        steps += 1
        assert eng.scheduler.running[0].num_computed_tokens - sched_before == min(7, 90 - sched_before)
    assert steps == 13
    assert len(eng.scheduler.running[0].page_ids) == 6  # ceil(90 / 16)


# ---- batch independence -------------------------------------------------------------------------
def test_batch_independence(model_dir):
    prompts = random_prompts(6, [3, 17, 40, 9, 70, 1], seed=5)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    solo_engine = make_engine(model_dir)  # reused: also checks that freed pages/slots are reset
    solo = [solo_engine.generate([p], params)[0].output_token_ids for p in prompts]
    _assert_all_freed(solo_engine)

    batched = make_engine(model_dir, max_num_batched_tokens=32)
    assert _tokens(batched.generate(prompts, params)) == solo

    # arrivals mid-way: two requests start, four more join while the first ones decode
    eng = make_engine(model_dir, max_num_batched_tokens=32)
    ids = [eng.add_request(p, params) for p in prompts[:2]]
    done: dict[str, RequestOutput] = {}
    for _ in range(4):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert eng.scheduler.running and eng.scheduler.running[0].output_token_ids  # really mid-way
    ids += [eng.add_request(p, params) for p in prompts[2:4]]
    eng.step()
    ids += [eng.add_request(p, params) for p in prompts[4:]]
    done.update(_run_to_end(eng))
    assert [done[i].output_token_ids for i in ids] == solo
    _assert_all_freed(eng)


# ---- preemption ---------------------------------------------------------------------------------
def _tiny_pool_engine(model_dir: Path, num_pages: int, max_num_seqs: int = 4, **kw) -> LLMEngine:
    """An engine whose budget holds exactly `num_pages` 16-token pages (+ the KDA slots)."""
    probe = make_engine(model_dir)
    cfg = probe.model_config
    page_bytes = CacheLayout(16, 0, 0).kv_bytes_per_page(cfg, torch.float32)
    slot_bytes = state_bytes_per_slot(cfg, torch.float32) * max_num_seqs if cfg.kda_layers else 0
    eng = make_engine(
        model_dir,
        kv_cache_memory_bytes=slot_bytes + num_pages * page_bytes,
        max_num_seqs=max_num_seqs,
        max_model_len=num_pages * 16,
        **kw,
    )
    assert eng.pages.capacity == num_pages
    assert eng.cache.nbytes() == slot_bytes + num_pages * page_bytes  # the budget is the real size
    return eng


PREEMPT_LENS = [20, 25, 30, 35]  # +24 tokens each: 3+4+4+4 = 15 pages wanted, 8 available


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded-t0.8"])
def test_preemption_recompute_gives_same_tokens(model_dir, seeded):
    prompts = random_prompts(4, PREEMPT_LENS, seed=6)
    if seeded:
        params = [SamplingParams(max_tokens=24, temperature=0.8, seed=100 + i, ignore_eos=True) for i in range(4)]
    else:
        params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * 4
    ref_engine = make_engine(model_dir)
    ref = ref_engine.generate(prompts, params)
    assert ref_engine.scheduler.num_preemptions == 0
    assert all(o.num_preemptions == 0 for o in ref)

    eng = _tiny_pool_engine(model_dir, num_pages=8)
    outs = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions > 0
    assert sum(o.num_preemptions for o in outs) == eng.scheduler.num_preemptions
    assert _tokens(outs) == _tokens(ref)
    assert all(o.finish_reason == "length" for o in outs)
    _assert_all_freed(eng)
    if seeded:  # the sampled run must really have sampled, or this is just the greedy test again
        greedy = make_engine(model_dir).generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        assert _tokens(outs) != _tokens(greedy)


# ---- KDA state: chunked WY prefill vs token by token --------------------------------------------
def _kda_state_after_prefill(model_dir: Path, prompt: list[int], budget: int):
    eng = make_engine(model_dir, max_num_batched_tokens=budget)
    eng.add_request(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for _ in range(-(-len(prompt) // budget)):
        eng.step()
    req = eng.scheduler.running[0]
    assert req.num_computed_tokens == len(prompt) and len(req.output_token_ids) == 1
    slot = req.slot_ids[0]
    layers = eng.model_config.kda_layers
    assert layers == (0, 1, 2)
    return (
        {i: eng.cache.recurrent[i][slot].clone() for i in layers},
        {i: eng.cache.conv[i][slot].clone() for i in layers},
        req.output_token_ids[0],
    )


@pytest.mark.parametrize("n", [2, 64, 100, 150])
def test_kda_state_chunked_equals_token_by_token(tiny_models, n):
    """One chunk (chunked WY kernel) and 64/33-token pieces (WY with a carried state) end in the
    same KDA state as feeding the prompt token by token (recurrent kernel). 150 tokens cross two
    64-token WY chunk boundaries, so a state carried through a full chunk is checked too."""
    d = tiny_models["kimi_linear"]
    prompt = random_prompts(1, [n], seed=7 + n)[0]
    rec_r, conv_r, tok_r = _kda_state_after_prefill(d, prompt, budget=1)
    for budget in (1024, 64, 33):
        rec_c, conv_c, tok_c = _kda_state_after_prefill(d, prompt, budget=budget)
        assert tok_c == tok_r
        for i in rec_c:
            assert rec_c[i].abs().max() > 1e-3, "state is ~0: the comparison would be vacuous"
            msg = f"budget {budget} layer {i}"
            torch.testing.assert_close(rec_c[i], rec_r[i], atol=1e-5, rtol=0, msg=msg)
            torch.testing.assert_close(conv_c[i], conv_r[i], atol=1e-5, rtol=0, msg=msg)
            if n < 3:  # window of W-1=3 inputs, oldest first: the first 3-n are zero padding
                assert torch.all(conv_c[i][:, : 3 - n] == 0)
                assert torch.all(conv_c[i][:, 3 - n :].abs().sum(0) > 0)


# ---- kernels ------------------------------------------------------------------------------------
def _kda_inputs(t: int, seed: int, b: int = 2, h: int = 2, kd: int = 16, vd: int = 8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, kd, generator=g)
    k = torch.randn(b, t, h, kd, generator=g)
    v = torch.randn(b, t, h, vd, generator=g)
    # decay as in the model: A in [1, 16], dt in [1e-3, 1e-1] (stored inverse-softplus), so some
    # channels keep their state across several 64-token chunks and the carried state matters
    g_raw = torch.randn(b, t, h * kd, generator=g) * 0.3
    a_log = (torch.rand(h, generator=g) * 15 + 1).log()
    dt = torch.exp(torch.rand(h * kd, generator=g) * math.log(100) + math.log(1e-3))
    gate = kda_gate(g_raw, a_log, dt + torch.log(-torch.expm1(-dt)), kd)
    beta = torch.rand(b, t, h, generator=g)
    s0 = torch.randn(b, h, kd, vd, generator=g)
    return q, k, v, gate, beta, s0


@pytest.mark.parametrize("t", [1, 2, 63, 64, 65, 130, 200])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_kda_equals_recurrent(t, with_state):
    q, k, v, g, beta, s0 = _kda_inputs(t, seed=t)
    init = s0 if with_state else None
    o_r, s_r = naive_recurrent_kda(q, k, v, g, beta, init)
    o_c, s_c = naive_chunk_kda(q, k, v, g, beta, init)
    assert o_c.shape == o_r.shape == (2, t, 2, 8) and s_c.shape == s_r.shape == (2, 2, 16, 8)
    torch.testing.assert_close(o_c, o_r, atol=1e-5, rtol=0)
    torch.testing.assert_close(s_c, s_r, atol=1e-5, rtol=0)
    if with_state:  # the initial state is read, not ignored, and not modified in place
        o_0, _ = naive_recurrent_kda(q, k, v, g, beta, None)
        assert (o_0 - o_r).abs().max() > 1e-3
        assert torch.equal(init, _kda_inputs(t, seed=t)[5])


def test_chunk_kda_split_sequence_equals_whole():
    """Feeding the chunked kernel in pieces (carrying the state) equals one call."""
    q, k, v, g, beta, _ = _kda_inputs(130, seed=11)
    o_all, s_all = naive_chunk_kda(q, k, v, g, beta)
    state, outs = None, []
    for s, e in [(0, 7), (7, 64), (64, 65), (65, 130)]:
        o, state = naive_chunk_kda(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), o_all, atol=1e-5, rtol=0)
    torch.testing.assert_close(state, s_all, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pieces", [[1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [2, 1, 7, 3], [13]])
def test_short_conv_pieces_equal_one_piece(pieces):
    g = torch.Generator().manual_seed(0)
    c, w, t = 12, 4, 13
    x = torch.randn(t, c, generator=g)
    weight = torch.randn(c, w, generator=g)
    y_all, win_all = naive_short_conv(x, weight, None)
    assert win_all.shape == (c, w - 1)
    torch.testing.assert_close(win_all, x[-(w - 1) :].t())  # last W-1 pre-conv inputs, oldest first
    window, ys, pos = None, [], 0
    for n in pieces:
        y, window = naive_short_conv(x[pos : pos + n], weight, window)
        ys.append(y)
        pos += n
    torch.testing.assert_close(torch.cat(ys), y_all, atol=1e-6, rtol=0)
    torch.testing.assert_close(window, win_all, atol=0, rtol=0)
    # the direct definition: y_t = silu(sum_j w[:, j] * x_{t-W+1+j}) with zeros before the start
    xp = torch.cat([torch.zeros(w - 1, c), x])
    direct = torch.stack([(xp[i : i + w].t() * weight).sum(-1) for i in range(t)])
    torch.testing.assert_close(y_all, torch.nn.functional.silu(direct), atol=1e-5, rtol=0)


# ---- stop conditions ----------------------------------------------------------------------------
def _pick_stop_token(out: list[int], at: int) -> tuple[int, int]:
    """The first token from position `at` on that does not occur earlier; returns (index, token)."""
    for i in range(at, len(out)):
        if out[i] not in out[:i]:
            return i, out[i]
    raise AssertionError(f"no fresh token in {out}")


def test_stop_token_ids(model_dir):
    prompt = random_prompts(1, [11], seed=8)[0]
    eng = make_engine(model_dir)
    full = eng.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    assert full.finish_reason == "length" and len(full.output_token_ids) == 20
    i, x = _pick_stop_token(full.output_token_ids, 5)
    out = eng.generate([prompt], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=(x,)))[0]
    assert out.output_token_ids == full.output_token_ids[: i + 1]
    assert out.output_token_ids[-1] == x
    assert out.finish_reason == "stop"
    # a stop token that only occurs in the prompt does not stop generation
    out = eng.generate([prompt], SamplingParams(max_tokens=5, temperature=0, stop_token_ids=(prompt[-1],)))[0]
    assert prompt[-1] not in full.output_token_ids[:5]
    assert out.output_token_ids == full.output_token_ids[:5] and out.finish_reason == "length"
    _assert_all_freed(eng)


def test_eos_stops_and_ignore_eos(model_dir, tmp_path):
    """Make the k-th greedy token the model's EOS (config.json) and check where generation stops."""
    prompt = random_prompts(1, [9], seed=9)[0]
    full = (
        make_engine(model_dir)
        .generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
        .output_token_ids
    )
    i, x = _pick_stop_token(full, 4)
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = [x, 2]
    (d / "config.json").write_text(json.dumps(cfg))
    eng = make_engine(d)
    assert eng.model_config.eos_token_ids == (x, 2)
    out = eng.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
    assert out.output_token_ids == full[: i + 1]
    assert out.finish_reason == "stop"
    out = eng.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert out.output_token_ids == full and out.finish_reason == "length"
    # ignore_eos does not switch off explicit stop tokens
    out = eng.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=(x,)))[0]
    assert out.output_token_ids == full[: i + 1] and out.finish_reason == "stop"
    _assert_all_freed(eng)


def test_max_tokens_and_max_model_len(model_dir):
    prompt = random_prompts(1, [30], seed=10)[0]
    eng = make_engine(model_dir)
    full = eng.generate([prompt], SamplingParams(max_tokens=15, temperature=0, ignore_eos=True))[0]
    assert len(full.output_token_ids) == 15 and full.finish_reason == "length"
    one = eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0]
    assert one.output_token_ids == full.output_token_ids[:1] and one.finish_reason == "length"

    short = make_engine(model_dir, max_model_len=40)
    assert short.max_model_len == 40
    out = short.generate([prompt], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert out.output_token_ids == full.output_token_ids[:10]  # 30 + 10 = max_model_len
    assert out.finish_reason == "length"
    # a prompt of max_model_len - 1 tokens gets exactly one token
    p39 = random_prompts(1, [39], seed=11)[0]
    out = short.generate([p39], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 1 and out.finish_reason == "length"
    _assert_all_freed(short)


# ---- resources ----------------------------------------------------------------------------------
def test_finished_requests_free_everything(model_dir):
    eng = make_engine(model_dir, max_num_batched_tokens=24, max_num_seqs=3)
    prompts = random_prompts(5, [4, 33, 16, 50, 1], seed=12)
    params = [
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.7, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0, logprobs=3, ignore_eos=True),
    ]
    outs = eng.generate(prompts, params)
    assert [len(o.output_token_ids) for o in outs] == [6, 9, 3, 1, 7]
    assert all(o.finished and o.finish_reason == "length" for o in outs)
    _assert_all_freed(eng)
    assert eng.pages.num_free == eng.pages.capacity
    eng.prompt_logits(prompts[3])
    _assert_all_freed(eng)


def test_abort_mid_generation_frees_and_others_finish(model_dir):
    prompts = random_prompts(3, [20, 35, 12], seed=13)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    solo_engine = make_engine(model_dir)
    solo = [solo_engine.generate([p], params)[0].output_token_ids for p in prompts]

    eng = make_engine(model_dir)
    ids = [eng.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    for _ in range(3):
        eng.step()
    victim = next(r for r in eng.scheduler.running if r.request_id == "r1")
    held_pages = len(victim.page_ids)
    assert held_pages == 3  # 35 prompt + 3 output tokens over 16-token pages
    pages_before = eng.pages.num_used
    slots_before = eng.slots.num_used if eng.slots is not None else 0
    eng.abort_request("r1")
    assert eng.pages.num_used == pages_before - held_pages
    if eng.slots is not None:
        assert eng.slots.num_used == slots_before - 1
    assert victim.finish_reason == "abort" and victim.page_ids == [] and victim.slot_ids == []
    assert [r.request_id for r in eng.scheduler.running] == ["r0", "r2"]
    eng.abort_request("r1")  # aborting twice (or an unknown id) is a no-op
    eng.abort_request("nope")
    done = _run_to_end(eng)
    assert set(done) == {"r0", "r2"}
    assert done["r0"].output_token_ids == solo[0]
    assert done["r2"].output_token_ids == solo[2]
    _assert_all_freed(eng)
    # the id is free again after the abort
    assert eng.add_request(prompts[1], params, request_id=ids[1]) == "r1"
    assert _run_to_end(eng)["r1"].output_token_ids == solo[1]
    _assert_all_freed(eng)


def test_abort_waiting_request(model_dir):
    eng = make_engine(model_dir, max_num_seqs=1)
    prompts = random_prompts(2, [10, 14], seed=14)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    eng.add_request(prompts[0], params, request_id="a")
    eng.add_request(prompts[1], params, request_id="b")
    eng.step()
    assert [r.request_id for r in eng.scheduler.waiting] == ["b"]
    eng.abort_request("b")
    assert not eng.scheduler.waiting
    done = _run_to_end(eng)
    assert set(done) == {"a"}
    assert done["a"].output_token_ids == make_engine(model_dir).generate([prompts[0]], params)[0].output_token_ids
    _assert_all_freed(eng)
