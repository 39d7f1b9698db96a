"""Which aten ops a decode step runs, and from where: one static decode step (the graph's body, run eagerly) under a
TorchDispatchMode that records every op that is not a view or a no-op, with the project's innermost frames.

    python -m bench.op_sites --ctx 4096 --batch 1 [--frames 3]      # the mid model on the GPU
    python -m bench.op_sites --tiny --ctx 64 --batch 2               # the tiny model on the host (plumbing)

On the GPU every op listed is a kernel launch, so a graph node with its own gap; Triton and fla launches are
not aten ops and do not show (the profiler's census counts them). torch.profiler's stacks did not name the
step's copy kernels (``bench/mid/profile.copy_sites``: an op's Python parents are not recorded in torch 2.11),
the dispatch mode sees the Python stack of each op as it runs.
"""

from __future__ import annotations

import argparse
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.mid import tandem_bench
from engine.llm_engine import LLMEngine

_VIEWS = {
    "alias", "as_strided", "chunk", "detach", "empty", "empty_like", "empty_strided", "expand", "expand_as",
    "flatten", "is_same_size", "lift_fresh", "narrow", "new_empty", "permute", "reshape", "resize_", "select",
    "set_", "slice", "split", "split_with_sizes", "squeeze", "sym_numel", "sym_size", "sym_storage_offset",
    "sym_stride", "t", "transpose", "unbind", "unflatten", "unsqueeze", "view", "view_as", "_unsafe_view",
    "_local_scalar_dense", "_reshape_alias",
}  # fmt: skip
_OWN = ("/engine/", "/kernels/", "/bench/mid/")


def _frames(depth: int) -> str:
    own = [f for f in traceback.extract_stack() if any(o in f.filename for o in _OWN)]
    return " <- ".join(f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno}" for f in own[::-1][:depth])


class OpSites(TorchDispatchMode):
    """Counts (op, call site) for ops that compute something: views and ops that return their input are left out."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.depth, self.counts, self.recording = depth, Counter(), False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.recording and name not in _VIEWS and not (args and out is args[0] and not name.endswith("_")):
            self.counts[(str(func), _frames(self.depth))] += 1
        return out


def static_step_sites(eng: LLMEngine, depth: int = 3) -> Counter:
    """The ops of the next decode step's static forward (DecodeGraphs._forward, eagerly: capture and overlap off)."""
    graphs = eng.runner.decode_graphs
    if graphs is None:
        raise ValueError("the engine has no static decode steps (EngineConfig.cuda_graphs)")
    capture, overlap = graphs.capture, getattr(eng, "overlap", None)
    graphs.capture, eng.overlap = False, None
    mode = OpSites(depth)
    forward = graphs._forward

    def recorded(batch: Any, *a: Any) -> torch.Tensor:
        mode.recording = True
        try:
            return forward(batch, *a)
        finally:
            mode.recording = False

    graphs._forward = recorded
    try:
        with mode:
            eng.step()
    finally:
        del graphs._forward  # back to the method
        graphs.capture, eng.overlap = capture, overlap
    return mode.counts


def report(counts: Counter) -> str:
    lines = [f"{sum(counts.values())} aten ops a step"]
    for (op, site), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        lines.append(f"  {n:3d} x {op:40s} {site}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.op_sites", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (host verification)")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--frames", type=int, default=3)
    a = p.parse_args(argv)
    eng = tandem_bench.lone_prompt_engine(
        a.layers, a.tiny, [a.ctx], 16.0, max_num_seqs=max(a.batch, 2), cuda_graphs=True
    )
    rids = tandem_bench.fill_decode_batch(eng, a.ctx, a.batch)
    eng.step()  # the batch's first decode step (captures on CUDA); the next one is recorded
    print(report(static_step_sites(eng, a.frames)))
    tandem_bench.clear(eng, rids)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
