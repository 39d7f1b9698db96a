"""bench/decode_timeline.py's split of a trace's device ops: those a cudaGraphLaunch started (the captured step)
against everything else, and the gaps inside a replay against the gaps around it."""

from __future__ import annotations

from bench.decode_timeline import classify, per_step


def _ev(cat, name, ts, dur, corr):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_graph_ops_and_outside_ops_are_told_apart():
    events = [
        _ev("cuda_runtime", "cudaGraphLaunch", 0, 4, 1),
        _ev("cuda_runtime", "cudaMemcpyAsync", 1, 2, 2),
        _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 5, 2, 2),  # outside, then a 3 us gap
        _ev("kernel", "layer_a", 10, 5, 1),  # graph: 1 us gap between its two kernels
        _ev("kernel", "layer_b", 16, 4, 1),
        _ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 22, 1, 3),  # outside, 2 us after the graph
        _ev("cuda_runtime", "cudaGraphLaunch", 2, 4, 4),
        _ev("kernel", "layer_a", 30, 5, 4),  # the next replay, 7 us later
    ]
    c = classify(events)
    assert c["graph_launches"] == 2 and c["device_ops"] == 5
    assert c["graph_kernel_us"] == 14 and c["outside_us"] == 3
    assert c["graph_internal_gap_us"] == 1 and c["other_gap_us"] == 3 + 2 + 7
    assert c["span_us"] == 30 and c["busy_us"] == 17
    s = per_step(c, 2)
    assert s["graph_kernel_us"] == 7 and s["outside_ops"][0][0].startswith("Memcpy HtoD")


def test_a_trace_without_device_ops():
    assert classify([_ev("cuda_runtime", "cudaGraphLaunch", 0, 1, 1)]) == {"device_ops": 0}
