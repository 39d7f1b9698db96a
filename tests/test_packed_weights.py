"""CausalLM.pack_weights (done by the engine on CUDA): projections of one input as one GEMM, the parameters
rebound to views of the packed tensor. Same function (fp32 on the host: logits within GEMM rounding, greedy
tokens equal), no extra memory, the parameter names and counts unchanged."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams
from tests.conftest import make_engine, random_prompts


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_packed_model_computes_the_same(model_dir):
    prompts = random_prompts(3, [40, 9, 25], seed=4)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = make_engine(model_dir)
    eng = make_engine(model_dir)
    names = [n for n, _ in eng.model.named_parameters()]
    before = _param_bytes(eng.model)
    eng.model.pack_weights()
    assert [n for n, _ in eng.model.named_parameters()] == names
    assert _param_bytes(eng.model) == before
    packed_by = {
        "in_proj": ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj"),  # KDA
        "qkv": ("q_proj", "k_proj", "v_proj"),  # GQA
        "q_kv_a": ("q_proj", "kv_a_proj_with_mqa"),  # MLA (decode-sized steps)
        "gate_up": ("gate_proj", "up_proj"),
    }  # dense MLPs, shared experts
    n_packed = 0
    for mod in eng.model.modules():
        for attr, linears in packed_by.items():
            pp = getattr(mod, attr, None)
            if pp is None:
                continue
            n_packed += 1
            ptr = pp.weight.untyped_storage().data_ptr()
            assert all(getattr(mod, lin).weight.untyped_storage().data_ptr() == ptr for lin in linears), attr
    assert n_packed >= eng.model_config.num_hidden_layers
    for mod in eng.model.modules():  # KDA's f_b | g_b: one [2, P, K] tensor for one batched GEMM
        if getattr(mod, "fg_b", None) is not None:
            ptr = mod.fg_b.untyped_storage().data_ptr()
            assert all(getattr(mod, lin).weight.untyped_storage().data_ptr() == ptr for lin in ("f_b_proj", "g_b_proj"))
    for mod in eng.model.modules():  # KDA's q|k|v conv kernels: one tensor, built once
        if getattr(mod, "_conv_packed", None) is not None:
            ptr = mod._conv_packed.untyped_storage().data_ptr()
            assert all(getattr(mod, c).weight.untyped_storage().data_ptr() == ptr for c in ("q_conv1d", "v_conv1d"))
    for p in prompts:
        torch.testing.assert_close(eng.prompt_logits(p), ref.prompt_logits(p), atol=1e-4, rtol=0)
    want = [o.output_token_ids for o in ref.generate(prompts, greedy)]
    assert [o.output_token_ids for o in eng.generate(prompts, greedy)] == want
    if eng.model_config.kda_layers:  # Kimi: the experts' gate | up share one tensor too
        moe = [m for m in eng.model.modules() if type(m).__name__ == "SparseMoE"]
        assert moe and all(m.w13 is not None for m in moe)
        assert all(m.experts.w1.untyped_storage().data_ptr() == m.w13.untyped_storage().data_ptr() for m in moe)
