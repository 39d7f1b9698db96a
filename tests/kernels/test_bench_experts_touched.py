"""bench.mid.tandem_bench.experts_touched (the roofline's expert bytes) counts every MoE layer of a step, also when
the GPU backend routes a one-row step in one launch (kernels/moe/route_fused.py), which calls no ``route``: the
twenty-ninth session's first A / B read 45 % of roofline for a faster step because no layer was counted."""

from __future__ import annotations

import pytest

from bench.mid import tandem_bench
from tests.conftest import make_engine
from tests.kernels.test_gpu_backend import gpu_backends

pytestmark = pytest.mark.usefixtures("fla_unblocked")


@pytest.mark.parametrize("fused_rows", [1, 0], ids=["one_launch", "two_launches"])
def test_counts_every_moe_layer_of_a_one_row_step(tiny_models, fused_rows):
    eng = make_engine(tiny_models["kimi_linear"], max_num_batched_tokens=512)
    be = gpu_backends()
    be.moe.fused_route_rows = fused_rows
    eng.model.backends = be
    eng.model.pack_weights()
    tandem_bench.fill_decode_batch(eng, 20, 1)
    seen = tandem_bench.experts_touched(eng)
    cfg = eng.model_config
    assert len(seen) == sum(kind == "moe" for kind in cfg.mlp_kinds)
    assert all(s == cfg.num_experts_per_token for s in seen)  # one row: k distinct routed experts a layer
