"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels.

A batch-1 decode step is ~145 short kernels, most of them a few microseconds, and between two kernels the GPU
drains the first grid before it starts the second. With PDL the next kernel's programs are launched while the
current one still runs; each waits (``griddepcontrol.wait``) until the kernel before it has finished and its
writes are visible, so the launch and the programs' set-up overlap the previous kernel's tail instead of
following it. The rule that keeps this exact: a kernel launched with PDL calls ``pdl_enter`` before it touches
global memory, and ``pdl_enter`` waits first, then lets its own dependents launch. Kernels that are not ours
(cuBLAS, fla) are launched the ordinary way and wait for everything before them, as always.

One exception: FlashMLA launches its split-KV kernel with PDL but never waits inside it (csrc/sm90/decode/dense/
splitkv_mla.cuh: it counts on the kernel before it not letting it start early). A kernel that runs right before
it — our split planner, whose plan it reads — calls ``pdl_wait`` instead: it waits, but lets its dependents
start only as it finishes.

**Off by default** (``TANDEM_PDL=1`` turns it on for every family, ``TANDEM_PDL=gemv,moe`` for some): on the
H200 the 2,048-token one-row agreement run (``bench.gpu_agreement --one-at-a-time``) hit an illegal address with
PDL on, twice: before the planner took ``pdl_wait`` and after it, so some other launch pair still races; with
``TANDEM_PDL=0`` the same run is clean. The kernel chains of tests/kernels/test_pdl.py are bit-equal with it,
eagerly and in a graph. Until the racing pair is found (docs/PERFORMANCE.md, twenty-fifth and twenty-sixth
sessions; ``python -m bench.pdl_check`` compares each family's logits with ordinary launches, bit for bit) the
launches stay ordinary.

Inside a CUDA graph the launches become programmatic edges of the graph (CUDA 12.3+), so captured steps keep it.
Off the GPU (and under ``TRITON_INTERPRET=1``, which has no ``griddepcontrol``) it is always off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.triton_utils import is_interpreting

FAMILIES = ("gemv", "moe", "attention", "plan", "conv", "sampling")
"""The launch sites by kernel family (``pdl_kwargs``'s ``family``), so ``TANDEM_PDL`` can turn PDL on for some."""


@functools.cache
def _switch() -> frozenset[str]:
    """``TANDEM_PDL``: ``0`` (default) none, ``1`` every family, or a comma list of ``FAMILIES``."""
    choice = os.environ.get("TANDEM_PDL", "0").strip()
    if choice in ("0", ""):
        return frozenset()
    if choice == "1":
        return frozenset(FAMILIES)
    names = frozenset(n.strip() for n in choice.split(","))
    if not names <= set(FAMILIES):
        raise ValueError(f"TANDEM_PDL must be 0, 1 or a comma list of {', '.join(FAMILIES)}; got {choice!r}")
    return names


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(t: torch.Tensor, family: str) -> bool:
    """Whether a kernel of ``family`` working on ``t``'s device launches with PDL: a CUDA tensor on compute
    capability 9.0+, not interpreting, the family switched on by ``TANDEM_PDL`` (off by default: the module's
    docstring)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown PDL kernel family {family!r}; known: {', '.join(FAMILIES)}")
    if family not in _switch() or not t.is_cuda or is_interpreting():
        return False
    return _device_has_pdl(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_kwargs(t: torch.Tensor, family: str) -> dict[str, bool]:
    """The launch arguments of a kernel that calls ``pdl_enter`` (or ``pdl_wait``): its ``USE_PDL`` constexpr and
    Triton's ``launch_pdl`` option, both ``use_pdl(t, family)``."""
    on = use_pdl(t, family)
    return {"USE_PDL": on, "launch_pdl": on}


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """The first statement of a kernel that may be launched with PDL: wait until the kernel before it in the stream
    has finished (its writes visible, so no read here sees stale data and no write here races a read there),
    then allow the next kernel's programs to launch. A no-op when ``USE_PDL`` is False."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """``pdl_enter`` without the early start of the next kernel: for a kernel followed by a launch that does not wait
    on its own (FlashMLA's split kernel). A no-op when ``USE_PDL`` is False."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


__all__ = ["FAMILIES", "pdl_enter", "pdl_kwargs", "pdl_wait", "use_pdl"]
