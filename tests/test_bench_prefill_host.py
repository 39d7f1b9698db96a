"""bench/prefill_host.py on the host: the tiny mid checkpoint runs end to end, and the held step's host time
excludes the call that waits for the device."""

from __future__ import annotations

import cProfile
import json
import pstats
import time

import torch

from bench import prefill_host


def test_blocking_seconds_counts_only_the_waiting_calls():
    def step():
        x = torch.arange(1000)
        time.sleep(0.02)  # host work: not a wait
        return x.tolist()  # on CUDA the first sync after a held GPU: the wait

    prof = cProfile.Profile()
    prof.runcall(step)
    stats = pstats.Stats(prof)
    waits = prefill_host._blocking_seconds(stats)
    tolist = [tt for (_, _, name), (_, _, tt, _, _) in stats.stats.items() if "tolist" in name]
    assert tolist and waits == sum(tolist)
    assert waits < 0.02  # the sleep is host time, not counted as waiting


def test_tiny_run_writes_rows(tmp_path):
    out, traces = tmp_path / "host.json", tmp_path / "traces"
    argv = ["--tiny", "--lengths", "64", "--repeat", "1", "--top", "5", "--out", str(out), "--trace-dir", str(traces)]
    assert prefill_host.main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    # the profiled step's trace is kept and read back (on the host it has no device events to list)
    assert (traces / "prefill-64-trace.json.gz").is_file()
    assert row["gaps"] == "prefill-64-trace.json.gz: no device events in the trace"
    assert row["length"] == 64 and row["wall_s"] > 0 and row["host_enqueue_s"] >= 0
    assert row["host_before_runner_s"] > 0 and row["host_runner_s"] > 0
    assert "generate" in row["pstats"]
