"""bench/moe_route_gate_up.py's code path on the host at small shapes (interpreted kernels; timing stubbed): both
forms of the fused launch checked against the two launches, the MoE block in one launch against its two, every row
of the report written; a fused launch that differs stops the bench."""

from __future__ import annotations

import json

import pytest

import bench.moe_route_gate_up as bench


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(bench, "HID", 64)
    monkeypatch.setattr(bench, "E", 16)
    monkeypatch.setattr(bench, "INTER", 32)
    monkeypatch.setattr(bench, "TOP_K", 4)
    monkeypatch.setattr(bench, "graph_us", lambda fn, iters: (fn(), 2.0)[1])
    monkeypatch.setattr(bench, "copy_bandwidth", lambda dev: {"bytes_per_s": 1e12})


@pytest.mark.usefixtures("small")
def test_reports_both_forms_the_two_launches_and_the_block(tmp_path):
    out = tmp_path / "r.json"
    assert bench.main(["--device", "cpu", "--tokens", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for name in ("fused_flag", "fused_slot_words", "two_launches", "block_two_launches", "block_one_launch"):
        assert res[f"{name}_us"] == 2.0 and res[f"{name}_roofline"] > 0


@pytest.mark.usefixtures("small")
def test_a_fused_launch_that_differs_stops_it(monkeypatch):
    real = bench.two_launches

    def other_rows(*args):
        weights, ids, a = real(*args)
        return weights, ids, a + 1

    monkeypatch.setattr(bench, "two_launches", other_rows)
    with pytest.raises(SystemExit, match="differs from the two launches"):
        bench.main(["--device", "cpu", "--tokens", "1"])


@pytest.mark.usefixtures("small")
def test_the_router_and_the_shared_expert_rotate_over_their_copies(monkeypatch):
    """Each call reads another copy of the router and the shared expert (HBM, not L2, as in a decode step)."""
    real = bench.fused_module.route_gate_up
    seen: list[tuple[int, int]] = []

    def recording(x, w, *args, extra_expert=None, **kw):
        seen.append((w.data_ptr(), extra_expert))
        return real(x, w, *args, extra_expert=extra_expert, **kw)

    monkeypatch.setattr(bench.fused_module, "route_gate_up", recording)
    assert bench.main(["--device", "cpu", "--tokens", "2", "--copies", "3"]) == 0
    assert {shared for _, shared in seen} == {bench.E, bench.E + 1, bench.E + 2}
    assert len({ptr for ptr, _ in seen}) == 3
    with pytest.raises(SystemExit, match="--copies must be >= 1"):
        bench.main(["--device", "cpu", "--copies", "0"])


@pytest.mark.usefixtures("small")
def test_a_one_launch_block_that_differs_stops_it(monkeypatch):
    real = bench.fused_module.route_gate_up_down_norm

    def other_norm(*args, **kw):
        out, res = real(*args, **kw)
        return out + 1, res

    monkeypatch.setattr(bench.fused_module, "route_gate_up_down_norm", other_norm)
    with pytest.raises(SystemExit, match="block in one launch differs"):
        bench.main(["--device", "cpu", "--tokens", "1"])
