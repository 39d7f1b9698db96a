"""bench/mid/gaps.py: device idle gaps and the host ops inside them, on a synthetic trace and a real one."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from bench.mid.gaps import load_events, merged, report, summarise


def _x(name, cat, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_gaps_between_device_ops_name_the_host_work(tmp_path):
    events = [
        _x("plan", "cpu_op", 0, 30),  # before the first kernel
        _x("k1", "kernel", 30, 10),
        _x("k2", "kernel", 38, 12),  # overlaps k1: one busy interval 30..50
        _x("prepare", "user_annotation", 55, 200),
        _x("copy", "gpu_memcpy", 300, 20),
        _x("k3", "kernel", 330, 10),
        {"ph": "i", "name": "marker", "ts": 5},  # not a complete event: ignored
    ]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = summarise(load_events(path), min_gap_us=25)
    assert s["device_busy_us"] == 20 + 20 + 10 and s["span_us"] == 340
    assert [(g["gap_us"], g["where"]) for g in s["gaps"]] == [
        (250, "between device ops"),
        (30, "before the first device op"),
    ]
    assert s["gaps"][0]["host_ops"] == [["prepare", 200.0]]
    assert "250" not in report("t", s) and "0.25 ms" in report("t", s)


def test_merged_intervals():
    assert merged([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]


@pytest.mark.filterwarnings("ignore")
def test_a_real_cpu_trace_has_no_device_events(tmp_path):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    path = tmp_path / "cpu.json"
    prof.export_chrome_trace(str(path))
    events = load_events(path)
    assert any(e.get("cat") == "cpu_op" for e in events)
    assert summarise(events) == {"device_events": 0}
