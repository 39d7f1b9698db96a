"""The residual sum carried into the next layer's norm (engine/models/layers.PreNormDecoderLayer): every
residual add happens inside a norm — no add of its own per layer — and the values are bit for bit those of
adding after each layer (``TANDEM_FUSED_RESIDUAL=0``, the form before), aux taps included."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.backends.norm import TorchNormBackend
from engine.models.base import fused_residual_adds
from engine.sampling_params import SamplingParams
from tests.conftest import make_engine, random_prompts


class CountingNorms(TorchNormBackend):
    """The reference norms, counting the calls of the residual stream's norms (the layers' input and
    post-attention norms and the final one; not MLA's latent norm or the q / k norms)."""

    def __init__(self, weights: set[int]) -> None:
        self.weights, self.plain, self.fused, self._in_add = weights, 0, 0, False

    def rms_norm(self, x, weight, eps):
        self.plain += id(weight) in self.weights and not self._in_add
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        self.fused += id(weight) in self.weights
        self._in_add = True  # the reference add-norm normalises through rms_norm: not a plain call
        try:
            return super().add_rms_norm(x, residual, weight, eps)
        finally:
            self._in_add = False


def _counting(eng) -> CountingNorms:
    m = eng.model
    stream = [m.model.norm] + [n for layer in m.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    norms = CountingNorms({id(n.weight) for n in stream})
    eng.model.backends = dataclasses.replace(eng.model.backends, norm=norms)
    return norms


@pytest.mark.parametrize("fuse", [True, False])
def test_every_residual_add_is_inside_a_norm(model_dir, fuse):
    eng = make_engine(model_dir)
    eng.model.fuse_residual = fuse
    norms = _counting(eng)
    eng.prompt_logits(random_prompts(1, [11], seed=2)[0])
    n = eng.model_config.num_hidden_layers
    if fuse:  # the embeddings' norm alone is plain; each layer's two adds and the final one go into norms
        assert (norms.plain, norms.fused) == (1, 2 * n)
    else:  # the form before: a plain norm after each layer's add, only the post-attention add fused
        assert (norms.plain, norms.fused) == (n + 1, n)


def test_fused_residual_is_bitwise_the_unfused_form(model_dir):
    fused, unfused = make_engine(model_dir), make_engine(model_dir)
    unfused.model.fuse_residual = False
    n = fused.model_config.num_hidden_layers
    for eng in (fused, unfused):  # the drafter's taps: the embeddings, the first and the last layer's output
        eng.model.aux_layer_ids = (-1, 0, n - 1)
    prompts = random_prompts(3, [23, 5, 40], seed=7)
    for p in prompts:
        a, b = fused.prompt_logits(p), unfused.prompt_logits(p)
        assert torch.equal(a, b)
        assert torch.equal(fused.model.aux_states, unfused.model.aux_states)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert [o.output_token_ids for o in fused.generate(prompts, greedy)] == [
        o.output_token_ids for o in unfused.generate(prompts, greedy)
    ]


def test_the_switch_names_a_bad_value(monkeypatch):
    monkeypatch.setenv("TANDEM_FUSED_RESIDUAL", "yes")
    with pytest.raises(ValueError, match="TANDEM_FUSED_RESIDUAL"):
        fused_residual_adds()
    monkeypatch.setenv("TANDEM_FUSED_RESIDUAL", "0")
    assert fused_residual_adds() is False
    monkeypatch.delenv("TANDEM_FUSED_RESIDUAL")
    assert fused_residual_adds() is True
