"""Packed weights under tensor parallelism (as on CUDA, forced on the host with TANDEM_PACK_WEIGHTS=1): every
rank packs its own shards; tokens equal the unpacked single-rank engine's. Its own module: a parallel engine is
one per process, and test_parallel_tp.py keeps its engines open per module."""

from __future__ import annotations

from engine.parallel.config import ParallelConfig
from engine.sampling_params import SamplingParams
from tests.conftest import random_prompts
from tests.parallel import helpers

KW = dict(max_num_seqs=8)
DECODE = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_packed_weights_under_tp(models, monkeypatch):
    """Each rank packs its own shards (as on CUDA): q|k|v|f_a|g_a|b, experts' gate|up, dense gate|up."""
    monkeypatch.setenv("TANDEM_PACK_WEIGHTS", "1")
    eng = helpers.engine(models["kimi_linear"], ParallelConfig(tp=2), **KW)
    try:
        assert any(type(m).__name__ == "PackedProjection" for m in eng.model.modules())  # rank 0's shards
        prompts = tuple(tuple(p) for p in random_prompts(3, [5, 30, 51], seed=43))
        monkeypatch.setenv("TANDEM_PACK_WEIGHTS", "0")  # the single-rank reference unpacked
        want = helpers.reference(models["kimi_linear"], prompts, DECODE, **KW)
        assert helpers.tokens(eng.generate([list(p) for p in prompts], DECODE)) == want
    finally:
        eng.close()
