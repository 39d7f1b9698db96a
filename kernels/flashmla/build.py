"""Compile FlashMLA's dense MLA decode (sm90a, bf16) as a torch extension, once per build directory.

FlashMLA (deepseek-ai/FlashMLA) ships no wheel; vLLM and SGLang vendor it into their own builds. Tandem builds
only the pieces the decode step calls — the split-KV kernel, its scheduler-metadata kernel and its combine —
from the pinned sources that ``fetch_sources.sh`` writes (FlashMLA + its CUTLASS submodule), with FlashMLA's
own nvcc flags. Needs ``nvcc`` (CUDA 12.3+) and an sm90 GPU at run time; a build takes ~1-3 minutes and is
reused from ``build_dir`` after that (torch's extension cache keys it on the sources and flags).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SRC = REPO_ROOT / ".flashmla_src"
BINDING = Path(__file__).with_name("binding.cpp")

# The .cu files of FlashMLA's dense sm90 decode, relative to its csrc/
CUDA_SOURCES = (
    "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
    "smxx/decode/combine/combine.cu",
    "sm90/decode/dense/instantiations/bf16.cu",
)

# FlashMLA's setup.py flags (fp16 compiled out: Tandem's GPU cache is bf16)
NVCC_FLAGS = (
    "-O3",
    "-std=c++20",
    "-DNDEBUG",
    "-D_USE_MATH_DEFINES",
    "-DFLASH_MLA_DISABLE_FP16",
    "-Wno-deprecated-declarations",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "--use_fast_math",
)
CXX_FLAGS = ("-O3", "-std=c++20", "-DNDEBUG", "-DFLASH_MLA_DISABLE_FP16", "-Wno-deprecated-declarations")


def source_dir() -> Path:
    return Path(os.environ.get("TANDEM_FLASHMLA_SRC", DEFAULT_SRC))


def missing_sources(src: Path) -> list[str]:
    """Paths the build needs that ``src`` lacks (empty: ready to build)."""
    need = [src / "FlashMLA" / "csrc" / s for s in CUDA_SOURCES]
    need += [src / "FlashMLA" / "csrc" / "api" / "dense_decode.h", src / "cutlass" / "include" / "cute" / "tensor.hpp"]
    return [str(p) for p in need if not p.exists()]


def _import_built(path: str):
    """Import an already-built extension (``TANDEM_FLASHMLA_SO``: e.g. one built on another host of the same image)."""
    import importlib.util

    import torch  # noqa: F401  (the extension links against libtorch, loaded first)

    spec = importlib.util.spec_from_file_location("tandem_flashmla", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"TANDEM_FLASHMLA_SO={path} is not an importable extension")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def load_flashmla(src: str | None = None, build_dir: str | None = None, verbose: bool = False):
    """Build (or reuse) and import the extension; raises with what is missing instead of half-building."""
    if src is None and os.environ.get("TANDEM_FLASHMLA_SO"):
        return _import_built(os.environ["TANDEM_FLASHMLA_SO"])
    root = Path(src) if src else source_dir()
    missing = missing_sources(root)
    if missing:
        raise FileNotFoundError(
            f"FlashMLA sources not found under {root} (missing {missing[0]}); run kernels/flashmla/fetch_sources.sh"
            " or set TANDEM_FLASHMLA_SRC"
        )
    from torch.utils.cpp_extension import CUDA_HOME, load

    # CUDA 13 moved libcu++ (cuda/std/...) under include/cccl: nvcc finds it, the host compiler of the binding not
    cccl = (
        [str(Path(CUDA_HOME) / "include" / "cccl")]
        if CUDA_HOME and (Path(CUDA_HOME) / "include" / "cccl").is_dir()
        else []
    )
    csrc = root / "FlashMLA" / "csrc"
    out = Path(build_dir or os.environ.get("TANDEM_FLASHMLA_BUILD", root / "build"))
    out.mkdir(parents=True, exist_ok=True)
    threads = str(min(8, os.cpu_count() or 1))
    # wgmma / setmaxnreg need the sm_90a target; torch would otherwise add a plain sm_90 pass that rejects them
    prev_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
    try:
        return load(
            name="tandem_flashmla",
            sources=[str(BINDING)] + [str(csrc / s) for s in CUDA_SOURCES],
            extra_cflags=list(CXX_FLAGS),
            extra_cuda_cflags=list(NVCC_FLAGS) + ["--threads", threads],
            extra_include_paths=[
                str(csrc),
                str(csrc / "kerutils" / "include"),
                str(csrc / "sm90"),
                str(root / "cutlass" / "include"),
                str(root / "cutlass" / "tools" / "util" / "include"),
                *cccl,
            ],
            build_directory=str(out),
            verbose=verbose,
        )
    finally:
        if prev_arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = prev_arch


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m kernels.flashmla.build", description="build FlashMLA's dense decode")
    p.add_argument(
        "--src", default=None, help="sources from fetch_sources.sh (default: $TANDEM_FLASHMLA_SRC or .flashmla_src)"
    )
    p.add_argument("--build-dir", default=None, help="where the extension is built (default: <src>/build)")
    a = p.parse_args(argv)
    # the sources always: an exported TANDEM_FLASHMLA_SO (say, where this build is meant to land) must not turn
    # the build into an import of what is not built yet
    mod = load_flashmla(a.src or str(source_dir()), a.build_dir, verbose=True)
    print(f"built {mod.__file__}\nexport TANDEM_FLASHMLA_SO={mod.__file__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["CUDA_SOURCES", "load_flashmla", "main", "missing_sources", "source_dir"]
