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
