"""GPU kernel check: every fast kernel vs its naive reference at real shapes, with timings.

    python -m bench.gpu_kernels_check [--quick] [--only attention,moe,...]

Needs CUDA; no network, no model download. Shapes: Kimi-Linear (KDA 32 heads x 128, conv W=4; MLA 32 heads,
kv_lora_rank 512 + rope 64, nope 128, v 128; MoE 256 experts top-8, size 1024, hidden 2304) and a
Qwen3-8B-like GQA (32 q heads, 8 kv heads, head_dim 128); pages of 16 and 64 tokens, contexts around 4k
(page-unaligned). Each line prints the max abs / max rel (to max |ref|) / relative RMS error against the
reference (computed in fp32 from the same bf16 inputs), the kernel time (torch.cuda.Event, mean over
iterations after warm-up; metadata built outside the timed region, as the backend does once per step) and
the achieved bytes/s (memory-bound kernels) or FLOP/s (compute-bound ones). A section that fails (or needs
fla-core when it is not importable) prints why and the script goes on. Exit code 1 if any check failed.

Sections: attention (GQA, MLA absorbed / expanded, SDPA comparison), page_copy, short_conv, state_copy,
moe, kda (fla-core chunk_kda incl. chunk-boundary states, fused recurrent decode + spec), backends (GPU
vs reference backends on one mixed ForwardBatch at real shapes) and engine (tiny models: GPU backends vs
TANDEM_BACKEND=torch, greedy tokens). Runs in about 2-4 minutes on an H200, most of it Triton / fla
compilation and autotuning.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch

from bench.kernels_check.attention import section_attention, section_page_copy
from bench.kernels_check.conv_state_norms import section_norms, section_short_conv, section_state_copy
from bench.kernels_check.engine_backends import section_backends, section_engine
from bench.kernels_check.kda import section_kda
from bench.kernels_check.moe import section_moe, section_router
from bench.kernels_check.report import Report, kernel_ms, timed

# timed and kernel_ms are imported from here by other bench scripts
__all__ = ["SECTIONS", "kernel_ms", "main", "timed"]

SECTIONS = {
    "attention": section_attention,
    "page_copy": section_page_copy,
    "short_conv": section_short_conv,
    "state_copy": section_state_copy,
    "norms": section_norms,
    "moe": section_moe,
    "router": section_router,
    "kda": section_kda,
    "backends": section_backends,
    "engine": section_engine,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help=f"comma-separated sections of {','.join(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_kernels_check: no CUDA device; the CPU checks are `pytest tests/kernels` (TRITON_INTERPRET=1).")
        return 0
    names = [s for s in args.only.split(",") if s] or list(SECTIONS)
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    import triton

    print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    try:
        import fla

        print(f"fla-core {getattr(fla, '__version__', '?')}")
    except Exception as e:  # report and go on
        print(f"fla-core not importable ({type(e).__name__}: {e}); KDA checks will be skipped")
    torch.manual_seed(0)
    rep = Report()
    t_all = time.perf_counter()
    for name in names:
        print(f"\n== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            SECTIONS[name](rep, args.quick)
        except Exception:  # one broken section must not hide the others
            rep.errors.append(name)
            print(
                f"  ERROR in section {name}:\n" + "".join("    " + ln for ln in traceback.format_exc().splitlines(True))
            )
        torch.cuda.empty_cache()
        print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(
        f"\n{len(rep.rows)} lines, {len(rep.failures)} failed checks, {len(rep.errors)} sections with errors, "
        f"{time.perf_counter() - t_all:.0f} s total"
    )
    for f in rep.failures:
        print(f"  FAILED {f}")
    for e in rep.errors:
        print(f"  ERROR  {e}")
    return 1 if rep.failures or rep.errors else 0


if __name__ == "__main__":
    sys.exit(main())
