"""bench/op_sites.py: the aten ops of one static decode step, by call site (host: reference backends)."""

from __future__ import annotations

import pytest

from bench.op_sites import _VIEWS, report, static_step_sites
from engine.sampling_params import SamplingParams
from tests.conftest import make_engine, random_prompts


def test_a_static_step_is_recorded_by_site(model_dir):
    eng = make_engine(model_dir, max_num_seqs=4, cuda_graphs=True)
    for p in random_prompts(2, [9, 20]):
        eng.add_request(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    while not all(r.output_token_ids for r in eng._requests.values()):
        eng.step()
    before = eng.runner.decode_graphs.stats()["eager_static_steps"]
    counts = static_step_sites(eng)
    assert eng.runner.decode_graphs.stats()["eager_static_steps"] == before + 1  # one static step, recorded
    ops = {op for op, _ in counts}
    sites = {site for _, site in counts}
    assert "aten.index_select.out" in ops and "aten.argmax.default" in ops  # the step's input gather, its ids
    assert any(s.startswith("decode_graph/buffers.py") for s in sites)
    assert not {op.split(".")[1] for op in ops} & _VIEWS
    assert report(counts).startswith(f"{sum(counts.values())} aten ops a step")
    assert "_forward" not in vars(eng.runner.decode_graphs)  # the method is restored


def test_needs_static_steps(model_dir):
    eng = make_engine(model_dir)
    with pytest.raises(ValueError, match="static decode"):
        static_step_sites(eng)
