"""Kernel tests: every fast kernel against its naive reference.

Without CUDA the Triton kernels run under ``TRITON_INTERPRET=1`` (numpy on the CPU). ``@triton.jit`` picks
the interpreter when a kernel is *defined* (triton's own ``tl`` helpers included), so the variable is set
here, before triton is first imported, and our kernel modules are imported right away. It is then removed
again, so it does not leak into the rest of the session (e.g. the e2e workers' environment), and set again
only while this package's tests run (fla, imported by a fixture, needs it too). On a CUDA machine the same
tests run the compiled kernels on the GPU.

fla-core: the root conftest blocks ``fla`` for the whole session (the HF oracle must take its pure-torch
path). ``fla_unblocked`` lifts the block for this package only and restores it afterwards, removing fla from
``sys.modules`` so later tests cannot see it.
"""

from __future__ import annotations

import importlib
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError(
        "triton was imported before tests/kernels/conftest.py without TRITON_INTERPRET=1, so its kernels are "
        "compiled-mode and cannot run on this CPU-only machine: run with TRITON_INTERPRET=1 in the environment"
    )
_KERNELS = Path(__file__).resolve().parents[2] / "kernels"
TRITON_MODULES = tuple(
    sorted(
        "kernels." + ".".join(f.relative_to(_KERNELS).with_suffix("").parts)
        for f in _KERNELS.rglob("*.py")
        if "@triton.jit" in f.read_text()  # every module defining a kernel: a new one cannot be left out
    )
) + ("kernels.short_conv.fla_adapter",)


@contextmanager
def _interpreter():
    """TRITON_INTERPRET=1 plus the single-config autotune shim (kimi-linear.md §3.4): Triton's autotuner would
    benchmark candidate configs on a driver that does not exist. Needed by fla's autotuned kernels."""
    if ON_CUDA:
        yield
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # before the first `import triton`: tl's own jit helpers count too
    from triton.runtime import autotuner

    orig_prune = autotuner.Autotuner.prune_configs

    def first_config_only(self, kwargs, *args, **kw):
        return orig_prune(self, kwargs, *args, **kw)[:1]

    autotuner.Autotuner.prune_configs = first_config_only
    try:
        yield
    finally:
        autotuner.Autotuner.prune_configs = orig_prune
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


with _interpreter():  # define our kernels now, under the interpreter when there is no GPU
    for _name in TRITON_MODULES:
        importlib.import_module(_name)


@pytest.fixture(scope="package", autouse=True)
def _interpret_while_testing():
    with _interpreter():
        yield


@pytest.fixture(scope="package")
def fla_unblocked(_interpret_while_testing):
    """Make fla importable for the duration of this package."""
    blockers = [f for f in sys.meta_path if type(f).__name__ == "_BlockFla"]
    for f in blockers:
        sys.meta_path.remove(f)
    try:
        import fla  # noqa: F401
    except ImportError as e:  # a test extra is missing: fail loudly rather than skip
        raise RuntimeError("fla-core is a test dependency: pip install -e '.[test]'") from e
    yield
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        del sys.modules[name]
    for f in reversed(blockers):
        sys.meta_path.insert(0, f)
