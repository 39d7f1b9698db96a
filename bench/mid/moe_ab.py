"""An interleaved A/B of the MoE experts' prefill path on one engine (``python -m bench.gpu_mid --moe-prefill-ab``)."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from bench.mid import profile, tandem_bench
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def run_moe_prefill_ab(a: argparse.Namespace, eng: LLMEngine, res: dict[str, Any]) -> None:
    """Eager prefill with the MoE experts through torch's grouped GEMMs vs kernels/moe/prefill.py, on this
    engine, interleaved (off, on, off, on, ...) so both see the same host: wall (median) and kernel time."""
    moe = eng.model.backends.moe
    if not hasattr(moe, "prefill_kernels"):
        res["notes"].append("moe prefill A/B: this engine's MoE backend has no prefill kernels")
        return
    before = moe.prefill_kernels
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for length in a.prefill:
        ids = tandem_bench.prompt(length, eng.model_config.vocab_size, length)
        walls: dict[bool, list[float]] = {False: [], True: []}
        row: dict[str, Any] = {"length": length}
        for i in range(2 * (a.repeat + 1)):
            moe.prefill_kernels = bool(i % 2)
            _, t = tandem_bench.timed(lambda ids=ids: eng.generate([ids], one), eng.device)
            if i >= 2:  # the first pair warms up
                walls[moe.prefill_kernels].append(t)
        for on in (False, True):
            moe.prefill_kernels = on
            prof = profile.profiled(lambda ids=ids: eng.generate([ids], one), eng.device)
            key = "kernels" if on else "grouped"
            row[key] = {
                "wall_s": statistics.median(walls[on]),
                "kernel_s": profile.kernel_census(prof)["kernel_us_per_step"] / 1e6,
            }
        res.setdefault("moe_prefill_ab", []).append(row)
        g, k = row["grouped"], row["kernels"]
        print(
            f"tandem prefill {length}, MoE experts grouped_mm vs prefill kernels (interleaved, eager): wall "
            f"{g['wall_s'] * 1e3:.1f} vs {k['wall_s'] * 1e3:.1f} ms, kernels {g['kernel_s'] * 1e3:.1f} vs "
            f"{k['kernel_s'] * 1e3:.1f} ms",
            flush=True,
        )
    moe.prefill_kernels = before


__all__ = ["run_moe_prefill_ab"]
