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

**Off by default** (``TANDEM_PDL=1`` turns it on for every family, ``TANDEM_PDL=gemv,moe.align`` for some
families and launch sites, ``SITES``): on the
H200 the 2,048-token one-row agreement run (``bench.gpu_agreement --one-at-a-time``) hit an illegal address with
PDL on, twice: before the planner took ``pdl_wait`` and after it, so some other launch pair still races; with
``TANDEM_PDL=0`` the same run is clean. The kernel chains of tests/kernels/test_pdl.py are bit-equal with it,
eagerly and in a graph. Until the racing pair is found (docs/PERFORMANCE.md, twenty-fifth and twenty-sixth
sessions; ``python -m bench.pdl_check`` compares each family's logits with ordinary launches, bit for bit) the
launches stay ordinary.

Weights before the wait: a one-row GEMV launched with PDL asks for its own slice of the weight to be pulled into
L2 before ``griddepcontrol.wait`` (``PDL_PREFETCH``, kernels/gemv/triton.py). The weight is read-only, so no
ordering is needed for it, and HBM streams it while the short kernel before runs instead of after it.
``TANDEM_PDL_PREFETCH_MB`` bounds what one launch asks for (0, the default: none). Measured on the H200 (thirty-fourth
session, docs/PERFORMANCE.md): b1 steps with PDL on took 916.6 / 957.8 us (4k / 32k) without it and 931.2 / 979.5 us
with 16 MB, so it stays off; the knob is kept for the next form of the idea.

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

SITES = {
    "gemv": ("gemv", "gated_norm", "add_norm"),
    "moe": (
        "router_partials",
        "route",
        "router_route",
        "align",
        "block_counts",
        "block_rows",
        "block_place",
        "gate_up",
        "down",
        "combine",
    ),
    "attention": ("paged_attn", "merge_splits", "mla_decode", "latent_write"),
    "plan": ("flashmla_plan",),
    "conv": ("short_conv",),
    "sampling": ("chunk_max", "row_argmax"),
}
"""Every kernel launched through ``pdl_kwargs``, by family: its ``site`` is ``"family.kernel"``."""
FAMILIES = tuple(SITES)
"""``TANDEM_PDL`` takes families and sites, so a race can be bisected down to one launch (bench/pdl_check.py)."""
_ALL_SITES = frozenset(f"{family}.{kernel}" for family, kernels in SITES.items() for kernel in kernels)


@functools.cache
def _switch() -> frozenset[str]:
    """``TANDEM_PDL``: ``0`` (default) none, ``1`` every family, or a comma list of families and sites."""
    choice = os.environ.get("TANDEM_PDL", "0").strip()
    if choice in ("0", ""):
        return frozenset()
    if choice == "1":
        return frozenset(FAMILIES)
    names = frozenset(n.strip() for n in choice.split(","))
    if not names <= set(FAMILIES) | _ALL_SITES:
        raise ValueError(
            f"TANDEM_PDL must be 0, 1 or a comma list of families ({', '.join(FAMILIES)}) or sites (family.kernel: "
            f"kernels.pdl.SITES); got {choice!r}"
        )
    return names


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def switched_on(site: str) -> bool:
    """Whether ``TANDEM_PDL`` names ``site`` (``"family.kernel"``, one of ``SITES``) or its family."""
    if site not in _ALL_SITES:
        known = ", ".join(sorted(_ALL_SITES))
        raise ValueError(f"unknown PDL launch site {site!r}; known: kernels.pdl.SITES ({known})")
    on = _switch()
    return site in on or site.split(".")[0] in on


def use_pdl(t: torch.Tensor, site: str) -> bool:
    """Whether the kernel at ``site`` working on ``t``'s device launches with PDL: switched on (``switched_on``;
    off by default: the module's docstring), a CUDA tensor on compute capability 9.0+, not interpreting."""
    if not switched_on(site) or not t.is_cuda or is_interpreting():
        return False
    return _device_has_pdl(t.device.index if t.device.index is not None else torch.cuda.current_device())


def pdl_kwargs(t: torch.Tensor, site: str) -> dict[str, bool]:
    """The launch arguments of a kernel that calls ``pdl_enter`` (or ``pdl_wait``): its ``USE_PDL`` constexpr and
    Triton's ``launch_pdl`` option, both ``use_pdl(t, site)``."""
    on = use_pdl(t, site)
    return {"USE_PDL": on, "launch_pdl": on}


@functools.cache
def prefetch_budget_bytes() -> int:
    """``TANDEM_PDL_PREFETCH_MB``: the most bytes of weight a PDL launch asks into L2 before its wait (default 0)."""
    text = os.environ.get("TANDEM_PDL_PREFETCH_MB", "0").strip()
    try:
        mb = float(text)
    except ValueError:
        mb = -1.0
    if not 0 <= mb <= 1024:
        raise ValueError(f"TANDEM_PDL_PREFETCH_MB must be a number of MB in 0..1024 (0: no prefetch), got {text!r}")
    return int(mb * 2**20) // 16 * 16


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


__all__ = [
    "FAMILIES",
    "SITES",
    "pdl_enter",
    "pdl_kwargs",
    "pdl_wait",
    "prefetch_budget_bytes",
    "switched_on",
    "use_pdl",
]
