"""bench/trace_kernels.py: kernels grouped by name and grid, per step, costliest first."""

from __future__ import annotations

from bench.trace_kernels import kernel_table


def test_groups_by_name_and_grid_per_step():
    def k(name, grid, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "dur": dur, "args": {"grid": grid}}

    events = [k("gemv", [393, 1, 1], 21.0), k("gemv", [288, 1, 1], 10.0), k("gemv", [393, 1, 1], 23.0)]
    events += [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 99.0}, k("norm", [1, 1, 1], 2.0)]
    rows = kernel_table(events, steps=2)
    assert rows == [
        (22.0, 1, 22.0, "gemv", (393, 1, 1)),
        (5.0, 0, 10.0, "gemv", (288, 1, 1)),
        (1.0, 0, 2.0, "norm", (1, 1, 1)),
    ]
