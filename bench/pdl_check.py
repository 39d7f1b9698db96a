"""Programmatic dependent launch (kernels/pdl.py) against ordinary launches, kernel family by family: which
``TANDEM_PDL`` setting changes what the engine computes, or crashes it.

    python -m bench.pdl_check [--settings gemv moe attention plan conv sampling 1] [--drill] [--prompts 8]

``--drill``: every family that races is then run launch site by launch site (``kernels.pdl.SITES``:
``TANDEM_PDL=moe.align``), to name the one launch.

PDL changes when a kernel starts, never what it computes, so with it on every logit of every step must equal the
ordinary launches' bit for bit: any difference is a race. Each setting runs in a process of its own (an illegal
address poisons the CUDA context), after two runs with PDL off — the reference, and a control that shows two
processes agree bit for bit (Triton's autotuning choices are shared through its on-disk cache:
``TRITON_CACHE_AUTOTUNING=1``; if the control differs, only tokens are compared). Each process generates the same
prompts in each decode mode (eager, CUDA graphs, graphs + overlapped scheduling), one at a time (one-row steps)
and together, and records the logits of every step the runner and the decode graphs return.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

MODES = {"eager": {}, "graphs": {"cuda_graphs": True}, "overlapped": {"cuda_graphs": True, "async_scheduling": True}}


def _record_logits(eng: Any) -> list[torch.Tensor]:
    """Every logits tensor the runner and its decode graphs return, cloned on the device as it comes (a graph's
    output buffer is overwritten by its next replay)."""
    seen: list[torch.Tensor] = []

    def recording(fn):
        def wrapped(*a, **k):
            out = fn(*a, **k)
            seen.append(out.detach().clone())
            return out

        return wrapped

    eng.runner.execute = recording(eng.runner.execute)
    if eng.runner.decode_graphs is not None:
        eng.runner.decode_graphs.run = recording(eng.runner.decode_graphs.run)
    return seen


def run_child(a: argparse.Namespace) -> None:
    """One process, one ``TANDEM_PDL`` setting (from the environment): tokens and logits of every mode, saved."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.tiny_model import make_tiny_model

    model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "kimi_linear", arch="kimi_linear", preset=a.preset))
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 200, (a.prompts,), generator=g).tolist()
    prompts = [torch.randint(4, 500, (n,), generator=g).tolist() for n in lengths]
    greedy = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
    record: dict[str, Any] = {}
    for mode, flags in MODES.items():
        cfg = EngineConfig(model=model, device=a.device, dtype=a.dtype, kv_cache_memory_bytes=2 << 30, **flags)
        eng = LLMEngine(cfg)
        seen = _record_logits(eng)
        alone = [eng.generate([p], greedy)[0].output_token_ids for p in prompts]
        together = [r.output_token_ids for r in eng.generate(prompts, greedy)]
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
        record[mode] = {"tokens": alone + together, "logits": [t.float().cpu() for t in seen]}
        torch.save(record, a.child_out)  # what ran before a crash still counts
        del eng
    torch.save(record, a.child_out)


def compare(ref: dict[str, Any], got: dict[str, Any], logits: bool) -> dict[str, str]:
    """Per mode: 'equal', or where it first differs."""
    out = {}
    for mode in MODES:
        if mode not in got:
            out[mode] = "not run (the process died before it)"
            continue
        r, g = ref[mode], got[mode]
        bad = [i for i, (x, y) in enumerate(zip(r["tokens"], g["tokens"], strict=True)) if x != y]
        if bad:
            out[mode] = f"tokens differ in {len(bad)} of {len(r['tokens'])} sequences (first: {bad[0]})"
        elif not logits:
            out[mode] = "tokens equal"
        elif len(r["logits"]) != len(g["logits"]):
            out[mode] = f"{len(g['logits'])} logits tensors against {len(r['logits'])}"
        else:
            diff = [i for i, (x, y) in enumerate(zip(r["logits"], g["logits"], strict=True)) if not torch.equal(x, y)]
            worst = max((float((r["logits"][i] - g["logits"][i]).abs().max()) for i in diff), default=0.0)
            out[mode] = f"logits differ at {len(diff)} steps (first {diff[0]}, max {worst:.3g})" if diff else "equal"
    return out


def _run(a: argparse.Namespace, out: Path, setting: str) -> tuple[int, str, dict[str, Any]]:
    """One child process with ``TANDEM_PDL=setting``: (exit code, its last stderr line, what it recorded)."""
    cmd = [sys.executable, "-m", "bench.pdl_check", "--child-out", str(out), "--prompts", str(a.prompts),
           "--tokens", str(a.tokens), "--preset", a.preset, "--device", a.device, "--dtype", a.dtype]  # fmt: skip
    try:
        proc = subprocess.run(cmd, env={**os.environ, "TANDEM_PDL": setting}, capture_output=True, text=True,
                              timeout=a.timeout)  # fmt: skip
        rc, tail = proc.returncode, (proc.stderr.strip().splitlines() or [""])[-1]
    except subprocess.TimeoutExpired:
        rc, tail = -1, f"timed out after {a.timeout:.0f} s"
    return rc, tail, torch.load(out) if out.exists() else {}


def main(argv: list[str] | None = None) -> int:
    from kernels.pdl import FAMILIES, SITES

    p = argparse.ArgumentParser(prog="python -m bench.pdl_check", description=__doc__.splitlines()[0])
    p.add_argument("--settings", nargs="+", default=[*FAMILIES, "1"], help="TANDEM_PDL values to compare with 0")
    p.add_argument("--drill", action="store_true", help="then each launch site of every family that raced")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--preset", default="mla512", help="engine/tiny_model.py preset (mla512: FlashMLA's MLA dims)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a setting's process may take")
    p.add_argument("--device", default="cuda", help="cpu: a host check of the harness (PDL is off there)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child_out is not None:
        run_child(a)
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.pdl_check compares GPU launches: it needs a CUDA device")
    work = Path(tempfile.mkdtemp(prefix="pdl_check_"))
    rc, tail, ref = _run(a, work / "reference.pt", "0")
    if rc != 0 or not ref:
        raise SystemExit(f"the reference run (PDL off) failed: exit {rc}: {tail}")
    control = compare(ref, _run(a, work / "control.pt", "0")[2], logits=True)
    bitwise = all(v == "equal" for v in control.values())
    print(f"control (PDL off twice): {control}; comparing {'logits bit for bit' if bitwise else 'tokens only'}")
    queue, raced = list(a.settings), []
    for i, setting in enumerate(queue):  # grows with --drill
        rc, tail, got = _run(a, work / f"run{i}.pt", setting)
        verdict = compare(ref, got, logits=bitwise)
        ok = rc == 0 and all(v in ("equal", "tokens equal") for v in verdict.values())
        print(f"TANDEM_PDL={setting}: {'OK' if ok else 'RACE'} {verdict}{'' if rc == 0 else ' | ' + tail}", flush=True)
        if not ok:
            raced.append(setting)
            if a.drill and setting in SITES:
                queue += [f"{setting}.{kernel}" for kernel in SITES[setting]]
    print(f"raced: {', '.join(raced) or 'none'}")
    return 1 if raced else 0


if __name__ == "__main__":
    raise SystemExit(main())
