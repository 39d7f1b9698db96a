"""bench.mid.tandem_bench.experts_touched (the roofline's expert bytes) counts every MoE layer of a step, also when
the GPU backend routes a one-row step in one launch (kernels/moe/route_fused.py), which calls no ``route``: the
twenty-ninth session's first A / B read 45 % of roofline for a faster step because no layer was counted."""

from __future__ import annotations

import pytest

from bench.mid import tandem_bench
from tests.conftest import make_engine
from tests.kernels.test_gpu_backend import gpu_backends

pytestmark = pytest.mark.usefixtures("fla_unblocked")


@pytest.mark.parametrize(
    ("fused_rows", "route_gate_up"),
    [(1, False), (0, False), (1, True)],
    ids=["one_launch", "two_launches", "in_gate_up"],
)
def test_counts_every_moe_layer_of_a_one_row_step(tiny_models, fused_rows, route_gate_up):
    """in_gate_up: kernels/moe/route_gate_up.py routes without ``route_hidden`` too; the count's step routes apart."""
    eng = make_engine(tiny_models["kimi_linear"], max_num_batched_tokens=512)
    be = gpu_backends()
    be.moe.fused_route_rows = fused_rows
    be.moe.route_gate_up = route_gate_up
    eng.model.backends = be
    eng.model.pack_weights()
    tandem_bench.fill_decode_batch(eng, 20, 1)
    seen = tandem_bench.experts_touched(eng)
    cfg = eng.model_config
    assert len(seen) == sum(kind == "moe" for kind in cfg.mlp_kinds)
    assert all(s == cfg.num_experts_per_token for s in seen)  # one row: k distinct routed experts a layer
    assert be.moe.route_gate_up == route_gate_up  # put back
