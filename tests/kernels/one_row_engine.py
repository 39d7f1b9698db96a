"""The one-row MoE engine check shared by the MoE block tests (test_moe_combine_norm, test_moe_down_norm,
test_moe_route_gate_up): greedy tokens of the tiny Kimi model with the GPU backends under the interpreter, one
sequence at a time so every decode step is one row, weights packed as on CUDA, against the reference backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def one_row_launches(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, spied: list[str]
) -> tuple[dict[str, list[int]], int]:
    """Run the check (it asserts the tokens) with each of ``engine.backends.gpu_moe``'s functions in ``spied``
    recording its first argument's rows a call -> (those rows by function, decode steps x MoE layers: the calls
    a one-row block's launch makes)."""
    import engine.backends.gpu_moe as gpu_moe
    from engine.sampling_params import SamplingParams
    from tests.conftest import make_engine, random_prompts
    from tests.kernels.test_gpu_backend import gpu_backends

    monkeypatch.setenv("TANDEM_PACK_WEIGHTS", "1")
    rows: dict[str, list[int]] = {name: [] for name in spied}
    for name in spied:
        real = getattr(gpu_moe, name)

        def spy(x: Any, *a: Any, _real: Any = real, _seen: list[int] = rows[name], **kw: Any) -> Any:
            _seen.append(x.shape[0])
            return _real(x, *a, **kw)

        monkeypatch.setattr(gpu_moe, name, spy)
    prompts = random_prompts(2, [23, 40], seed=8)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    ref = make_engine(tiny_models["kimi_linear"])
    eng = make_engine(tiny_models["kimi_linear"])
    eng.model.backends = gpu_backends()
    moe_layers = sum(1 for layer in eng.model.layers if layer.is_moe)
    for prompt in prompts:
        want = ref.generate([prompt], params)[0].output_token_ids
        assert eng.generate([prompt], params)[0].output_token_ids == want
    return rows, len(prompts) * (params.max_tokens - 1) * moe_layers
