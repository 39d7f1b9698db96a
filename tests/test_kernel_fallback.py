"""engine/backends/fallback.py: a failed fast path falls back with a warning, or raises with
TANDEM_KERNEL_FALLBACK=0 (what the GPU benchmarks set, so they never time the fallback)."""

from __future__ import annotations

import logging

import pytest

from engine.backends.fallback import fall_back, fallbacks_allowed


def test_falls_back_with_a_warning_by_default(monkeypatch, caplog):
    monkeypatch.delenv("TANDEM_KERNEL_FALLBACK", raising=False)
    assert fallbacks_allowed()
    with caplog.at_level(logging.WARNING, logger="tandem.backends"):
        try:
            raise ValueError("no sm_90 cubin")
        except ValueError as err:
            fall_back("MoE decode kernels", "decode steps use the grouped path", err)
    assert "MoE decode kernels failed (no sm_90 cubin); decode steps use the grouped path" in caplog.text


def test_raises_when_fallbacks_are_off(monkeypatch):
    monkeypatch.setenv("TANDEM_KERNEL_FALLBACK", "0")
    with pytest.raises(RuntimeError, match="MoE decode kernels failed and TANDEM_KERNEL_FALLBACK=0: no sm_90") as info:
        try:
            raise ValueError("no sm_90 cubin")
        except ValueError as err:
            fall_back("MoE decode kernels", "decode steps use the grouped path", err)
    assert isinstance(info.value.__cause__, ValueError)


def test_rejects_other_values(monkeypatch):
    monkeypatch.setenv("TANDEM_KERNEL_FALLBACK", "strict")
    with pytest.raises(ValueError, match="TANDEM_KERNEL_FALLBACK must be 0 or 1"):
        fallbacks_allowed()
