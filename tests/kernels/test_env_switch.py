"""kernels/env.py's on / off switches, and the kernels' switches read through it: each reads its own variable, is
off unset or blank, and names the variable when its value is neither 0 nor 1; the KDA up-projections' channel
cap (a number, read the same way)."""

from __future__ import annotations

import pytest

from engine.backends.gpu_kda_switches import low_rank_block_c_from_env
from kernels.env import env_switch
from kernels.moe.down_norm import tile_tickets_from_env
from kernels.short_conv.in_proj_conv import in_proj_conv_from_env


@pytest.mark.parametrize(("raw", "default", "want"), [(None, False, False), (None, True, True), ("", True, True),
                                                      (" 1 ", False, True), ("0", True, False)])  # fmt: skip
def test_values(monkeypatch, raw, default, want):
    if raw is None:
        monkeypatch.delenv("TANDEM_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("TANDEM_TEST_SWITCH", raw)
    assert env_switch("TANDEM_TEST_SWITCH", default) is want


@pytest.mark.parametrize(
    ("name", "read"),
    [("TANDEM_MOE_DOWN_TILE_TICKETS", tile_tickets_from_env), ("TANDEM_KDA_IN_PROJ_CONV", in_proj_conv_from_env)],
)
def test_kernel_switches(monkeypatch, name, read):
    monkeypatch.delenv(name, raising=False)
    assert read() is False
    monkeypatch.setenv(name, "1")
    assert read() is True
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ValueError, match=f"{name} must be 0 or 1, got 'yes'"):
        read()


def test_low_rank_block_c(monkeypatch):
    monkeypatch.delenv("TANDEM_KDA_LOW_RANK_BLOCK_C", raising=False)
    assert low_rank_block_c_from_env() == 256
    monkeypatch.setenv("TANDEM_KDA_LOW_RANK_BLOCK_C", " 64 ")
    assert low_rank_block_c_from_env() == 64
    monkeypatch.setenv("TANDEM_KDA_LOW_RANK_BLOCK_C", "100")
    with pytest.raises(ValueError, match="TANDEM_KDA_LOW_RANK_BLOCK_C must be 16, 32, 64, 128 or 256, got '100'"):
        low_rank_block_c_from_env()
