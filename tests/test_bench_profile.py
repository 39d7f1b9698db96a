"""bench/mid/profile.py: the per-group breakdown attributes GPU kernels by the GPU-side spans of the labelled
ranges (a synthetic profile: Triton kernels have no aten op, so the CPU-side attribution missed them)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.autograd import DeviceType

from bench.mid.profile import breakdown


def _ev(name, start, end, device_type=DeviceType.CUDA):
    return SimpleNamespace(name=name, device_type=device_type, time_range=SimpleNamespace(start=start, end=end))


def test_kernels_count_in_the_innermost_span_and_the_rest_is_other():
    events = [
        _ev("tandem.MoE", 100, 200),
        _ev("_gate_up_kernel", 100, 150),  # a Triton kernel inside the MoE span
        _ev("_down_kernel", 150, 190),
        _ev("tandem.attention", 300, 400),
        _ev("tandem.GEMM", 320, 340),  # nested: the GEMM span is innermost for the kernel inside it
        _ev("nvjet_gemm", 322, 338),
        _ev("_paged_attn_fwd_kernel", 345, 395),
        _ev("rms_norm_kernel", 400, 410),  # outside every span: other
        _ev("tandem.MoE", 100, 200, DeviceType.CPU),  # CPU-side ranges are not spans
        _ev("aten::mm", 0, 1000, DeviceType.CPU),
    ]
    prof = SimpleNamespace(events=lambda: events)
    bd = breakdown(prof, torch.device("cuda"), per=2)
    assert bd["MoE"] == 90 / 1e3 / 2
    assert bd["GEMM"] == 16 / 1e3 / 2
    assert bd["attention"] == 50 / 1e3 / 2
    assert bd["KDA"] == 0.0
    assert bd["total"] == 166 / 1e3 / 2
    assert abs(bd["other"] - 10 / 1e3 / 2) < 1e-12


def test_copy_sites_group_copy_kernels_by_their_project_frames():
    from bench.mid.profile import copy_sites

    def op(name, stack, kernels):
        ks = [SimpleNamespace(duration=d) for d in kernels]
        return SimpleNamespace(name=name, device_type=DeviceType.CPU, kernels=ks, stack=stack)

    kda = ["torch/_tensor.py(1): contiguous", "kernels/kda/fla_adapter.py(70): _flat", "engine/x.py(5): run"]
    events = [
        op("aten::copy_", kda, [40.0]),
        op("aten::copy_", kda, [44.0]),
        op("aten::copy_", ["engine/models/m.py(9): fwd"], [5.0]),
        op("aten::cat", ["engine/models/m.py(12): fwd"], [3.0, 1.0]),
        op("aten::copy_", kda, []),  # launched nothing (a host copy): not counted
        SimpleNamespace(  # no stack of its own (torch >= 2.11): the enclosing python_function events' names
            name="aten::copy_",
            device_type=DeviceType.CPU,
            kernels=[SimpleNamespace(duration=6.0)],
            stack=[],
            cpu_parent=SimpleNamespace(
                name="aten::clone",
                cpu_parent=SimpleNamespace(
                    name="engine/models/m.py(9): fwd", cpu_parent=SimpleNamespace(name="run.py(1): <module>")
                ),
            ),
        ),
        op("aten::mm", kda, [100.0]),  # not a copy
        _ev("elementwise_kernel", 0, 40),  # device events are read through their op
    ]
    rows = copy_sites(SimpleNamespace(events=lambda: events), per=2, depth=2)
    assert rows[0] == ("aten::copy_ <- kernels/kda/fla_adapter.py(70): _flat <- engine/x.py(5): run", 1.0, 42.0)
    assert rows[1:] == [
        ("aten::copy_ <- engine/models/m.py(9): fwd", 1.0, 5.5),
        ("aten::cat <- engine/models/m.py(12): fwd", 1.0, 2.0),
    ]


def test_own_frames_reads_the_python_stack_of_a_real_profile():
    """torch records Python frames as enclosing events; the walk finds the project's frame above an aten op."""
    from torch.profiler import ProfilerActivity, profile

    from bench.mid.profile import _own_frames
    from kernels.moe.grouped import moe_combine

    y, rows, w = torch.randn(8, 4), torch.randperm(8), torch.rand(4, 2)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        moe_combine(y, rows, w, torch.float32)
    index = next(e for e in prof.events() if e.name == "aten::index")
    frames = _own_frames(index)
    assert frames and "kernels/moe/grouped.py(" in frames[0] and frames[0].endswith("): moe_combine")
