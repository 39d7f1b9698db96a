"""bench/sm90_report.py: the gate-up kernels compiled for sm_90a on this GPU-less host (Triton's compiler and its
bundled ptxas), run as the command a developer runs; the TMA variant must read its weights through TMA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sm90_report_shows_the_tma_variant_reading_weights_through_tma():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for the GPU, not interpret
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = subprocess.run(
        [sys.executable, "-m", "bench.sm90_report"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith(("| gate-up", "| down")):
            # registers, spills, shared KB, wgmma, TMA copies, cp.async, setmaxnreg
            rows[cells[0]] = [int(c) for c in cells[1:]]
    assert len(rows) == 8, out.stdout
    pointer, tma = rows["gate-up pointer, 3 stages"], rows["gate-up TMA weights, 3 stages"]
    assert pointer[3] > 0 and tma[3] > 0  # both on Hopper's wgmma
    assert pointer[4] == 0 and tma[4] > 0  # only the variant issues TMA copies
    assert tma[0] < pointer[0] and tma[1] == 0  # fewer registers a thread, no spills
    down, down_tma = rows["down pointer, 4 stages"], rows["down TMA both operands, 4 stages"]
    assert down[3] > 0 and down_tma[3] > 0 and down_tma[1] == 0
    assert down_tma[4] > 0 and down_tma[5] == 0  # both operands by TMA: no cp.async left
