"""Speculative decoding in one process: lossless outputs, acceptance accounting, KDA rollback,
distribution-preserving rejection sampling, aux taps."""

from __future__ import annotations

import pytest
import torch

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.spec.aux_tap import make_tiny_drafter
from engine.spec.verify import verify_drafts
from tests.conftest import make_engine, random_prompts

MAX = 40
GREEDY = SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rep = random_prompts(1, [12], seed=50)[0]
    return [rep * 4, *random_prompts(3, [5, 33, 70], seed=51)]  # a repetitive one gives n-gram hits


@pytest.fixture(scope="module")
def drafters(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafters")
    return {
        "kimi_linear": make_tiny_drafter(root / "kimi", tiny_models["kimi_linear"], aux_layer_ids=(-1, 1, 3)),
        "qwen3": make_tiny_drafter(root / "qwen3", tiny_models["qwen3"], aux_layer_ids=(-1, 2)),
    }


@pytest.fixture(scope="module")
def reference(tiny_models):
    return {
        arch: [o.output_token_ids for o in make_engine(d).generate(_prompts(), GREEDY)]
        for arch, d in tiny_models.items()
    }


@pytest.mark.parametrize("method", ["ngram", "aux_tap"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_is_lossless(arch, model_dir, reference, drafters, method, k):
    spec = SpeculativeConfig(method, k, str(drafters[arch]) if method == "aux_tap" else None)
    outs = make_engine(model_dir, speculative=spec).generate(_prompts(), GREEDY)
    assert [o.output_token_ids for o in outs] == reference[arch]
    assert sum(o.num_verify_steps for o in outs) > 0
    if method == "ngram":
        assert sum(o.num_accepted for o in outs) > 0, "n-gram drafts should sometimes be right"


class OracleDrafter:
    """Proposes the target's own greedy continuation: full acceptance by construction."""

    needs_aux = False

    def __init__(self, prompts, outputs, corrupt_at: int | None = None):
        self.ref = {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}
        self.corrupt_at = corrupt_at

    def propose(self, req: Request, k: int, aux=None) -> list[int]:
        n = len(req.output_token_ids)
        out = list(self.ref[tuple(req.prompt_token_ids)][n : n + k])
        if self.corrupt_at is not None and self.corrupt_at < len(out):
            out[self.corrupt_at] = (out[self.corrupt_at] + 1) % 512
        return out


def test_oracle_drafter_is_fully_accepted_and_counted(arch, model_dir, reference):
    k = 3
    engine = make_engine(model_dir, speculative=SpeculativeConfig("ngram", k))
    engine.drafter = OracleDrafter(_prompts(), reference[arch])
    outs = engine.generate(_prompts(), GREEDY)
    assert [o.output_token_ids for o in outs] == reference[arch]
    for o in outs:
        assert o.acceptance_rate == 1.0
        # every verify step emits k+1 tokens, except the last ones cut by max_tokens
        assert o.num_verify_steps <= -(-(MAX - 1) // (k + 1)) + 1
        assert o.mean_accepted_length > k
    rand = make_engine(model_dir, speculative=SpeculativeConfig("ngram", k))
    rand.drafter = OracleDrafter(_prompts(), [[(t * 7 + 3) % 512 for t in r] for r in reference[arch]])
    routs = rand.generate(_prompts(), GREEDY)
    assert [o.output_token_ids for o in routs] == reference[arch]
    assert sum(o.num_accepted for o in routs) / sum(o.num_drafted for o in routs) < 0.1


def test_random_aux_tap_drafter_low_acceptance_exact_output(arch, model_dir, reference, drafters):
    engine = make_engine(model_dir, speculative=SpeculativeConfig("aux_tap", 3, str(drafters[arch])))
    outs = engine.generate(_prompts(), GREEDY)
    assert [o.output_token_ids for o in outs] == reference[arch]
    assert sum(o.num_accepted for o in outs) / sum(o.num_drafted for o in outs) < 0.2


def test_per_request_k_and_mixed_batches(arch, model_dir, reference):
    engine = make_engine(model_dir, speculative=SpeculativeConfig("ngram", 5))
    params = [
        SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True, num_speculative_tokens=k)
        for k in (0, 2, None, 5)
    ]
    outs = engine.generate(_prompts(), params)
    assert [o.output_token_ids for o in outs] == reference[arch]
    assert outs[0].num_drafted == 0 and outs[2].num_drafted > 0


@pytest.mark.parametrize("reject_at", [0, 1, 2, 3])
def test_kda_rollback_equals_never_seen(tiny_models, reference, reject_at):
    """Reject at every position (3 = all accepted): the KDA state equals a plain decode's."""
    model_dir = tiny_models["kimi_linear"]
    prompt, ref = _prompts()[1], reference["kimi_linear"][1]
    k = 3
    engine = make_engine(model_dir)
    rid = engine.add_request(prompt, GREEDY)
    req = engine._requests[rid]
    while not req.output_token_ids:
        engine.step()
    drafts = ref[1 : 1 + k]
    if reject_at < k:
        drafts[reject_at] = (drafts[reject_at] + 1) % 512
    req.draft_tokens = drafts
    engine.step()
    assert req.num_accepted == reject_at
    assert req.output_token_ids == ref[: 2 + reject_at]
    assert req.num_computed_tokens == len(prompt) + 1 + reject_at

    plain = make_engine(model_dir)
    prid = plain.add_request(prompt, GREEDY)
    preq = plain._requests[prid]
    while preq.num_computed_tokens < req.num_computed_tokens:
        plain.step()
    for layer in engine.cache.recurrent:
        torch.testing.assert_close(
            engine.cache.recurrent[layer][req.slot_ids[0]], plain.cache.recurrent[layer][preq.slot_ids[0]]
        )
        torch.testing.assert_close(engine.cache.conv[layer][req.slot_ids[0]], plain.cache.conv[layer][preq.slot_ids[0]])
    engine.drafter = None
    while engine.has_unfinished_requests():
        engine.step()
    assert req.output_token_ids == ref
    assert engine.slots.num_used == 0 and engine.pages.num_used == 0


@pytest.mark.parametrize("draft_kind", ["likely", "unlikely"])
def test_rejection_sampling_preserves_the_distribution(draft_kind):
    """Tiny vocabulary: the first emitted token's distribution equals the target's (chi-square)."""
    vocab, n = 6, 20000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=g) * 1.5
    p = torch.softmax(logits[0], -1)
    draft = int(p.argmax()) if draft_kind == "likely" else int(p.argmin())
    req = Request("x", [1, 2], SamplingParams(max_tokens=4, temperature=1.0))
    rng = torch.Generator().manual_seed(1)
    counts = torch.zeros(vocab)
    for _ in range(n):
        tokens, _ = verify_drafts(logits, [draft, 0], req, rng)
        counts[tokens[0]] += 1
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, f"chi2={chi2:.1f} (5 dof, p=0.001 critical value 20.5)"  # would be huge if biased


def test_speculative_sampling_runs_and_is_seeded(arch, model_dir):
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True)
    a = make_engine(model_dir, speculative=SpeculativeConfig("ngram", 3)).generate(_prompts(), params)
    b = make_engine(model_dir, speculative=SpeculativeConfig("ngram", 3)).generate(_prompts(), params)
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]
    assert all(len(o.output_token_ids) == 20 for o in a)


def test_aux_taps_equal_transformers_hidden_states(arch, model_dir):
    from transformers import AutoModelForCausalLM

    engine = make_engine(model_dir)
    taps = (-1, 0, 2)
    engine.model.aux_layer_ids = taps
    prompt = random_prompts(1, [23], seed=52)[0]
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    ours = engine.model.aux_states[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[t + 1][0, -1] for t in taps])
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)
