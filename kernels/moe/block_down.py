"""The down programs of the one-launch MoE block (``route_gate_up_down_norm`` in ``route_gate_up.py``): each waits
inside the launch for its slot's gate-up programs, streams its block of the expert's down rows, and the last of
them runs the combine + residual add + next norm.

Two knobs of the wait, both off by default and timed by ``bench/moe_route_gate_up.py`` (the thirty-eighth session
measured the block at 70 us in one launch against 59 us in two on an H100):
- ``TANDEM_MOE_BLOCK_POLL_NS``: a ``nanosleep`` of that many ns between two polls. The slots' counters share one
  128-byte line, so up to two waiting programs an SM poll one L2 slice, which also serves its share of every
  weight line the gate-up programs stream;
- ``TANDEM_MOE_BLOCK_PREFETCH=1``: before its wait, a program learns its expert (the host's for the shared expert;
  a routed slot's from the slot's word in ``SYNC``, which the routing's last program then writes beside the flag)
  and asks its block of down rows into L2 (``cp.async.bulk.prefetch.L2``), so they stream while the gate-up
  programs still run. The last down program puts the words back to 0.
Both are inline PTX (sm_90): under the interpreter they are off whatever the environment says.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.env import env_switch
from kernels.moe.combine_norm import combine_add_norm_row
from kernels.moe.decode import down_rows
from kernels.prefetch.triton import prefetch_span_to_l2
from kernels.triton_utils import is_interpreting

POLL_NS_ENV = "TANDEM_MOE_BLOCK_POLL_NS"
PREFETCH_ENV = "TANDEM_MOE_BLOCK_PREFETCH"
MAX_POLL_NS = 1_000_000  # nanosleep's cap (PTX ISA: [0, 1 ms])


@dataclass(frozen=True)
class DownNorm:
    """What the one-launch block's down programs take (``route_gate_up_down_norm``): the down weights and the next
    norm after the combine, checked against the launch's shapes; how they wait (the module's doc)."""

    w2: torch.Tensor  # [E (+1), H, I]
    residual: torch.Tensor  # [1, H], unit column stride
    norm_weight: torch.Tensor  # [H], contiguous
    eps: float
    poll_ns: int = 0
    prefetch: bool = False


def wait_options(poll_ns: int | None, prefetch: bool | None, w2: torch.Tensor) -> tuple[int, bool]:
    """(poll_ns, prefetch): the arguments, else the environment's; both 0 / off under the interpreter, and the
    prefetch off where w2's expert and row starts are not 16-byte aligned (a bulk prefetch's operand)."""
    if poll_ns is None:
        raw = os.environ.get(POLL_NS_ENV, "0")
        try:
            poll_ns = int(raw)
        except ValueError:
            raise ValueError(f"{POLL_NS_ENV} must be an integer number of ns, got {raw!r}") from None
    if not 0 <= poll_ns <= MAX_POLL_NS:
        raise ValueError(f"poll_ns must be in [0, {MAX_POLL_NS}] ns, got {poll_ns}")
    if prefetch is None:
        prefetch = env_switch(PREFETCH_ENV, False)
    if is_interpreting():
        return 0, False
    esz = w2.element_size()
    aligned = w2.data_ptr() % 16 == 0 and (w2.stride(0) * esz) % 16 == 0 and (w2.stride(1) * esz) % 16 == 0
    return poll_ns, prefetch and aligned


@triton.jit
def backoff(NS: tl.constexpr):
    """Sleep about NS ns (0: nothing), so a waiting warp leaves the L2 slice of its counter to other requests."""
    if NS > 0:
        tl.inline_asm_elementwise(
            "nanosleep.u32 $1;\n mov.u32 $0, 0;", "=r,r", [tl.full([1], NS, tl.int32)], dtype=tl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def wait_count(ptr, target, NS: tl.constexpr):
    """Poll the int32 at ptr until it reaches target (volatile loads: each one reads L2), then an acquire."""
    while tl.load(ptr, volatile=True) < target:
        backoff(NS)
    tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def block_down_program(
    d, A, W2, Y, SYNC, ID_OUT, W_OUT, RESIDUAL, NORM_W, OUT, RES_OUT, extra_id, H, INTER, stride_a, stride_w2e,
    stride_w2n, stride_y, eps,
    N_COLS: tl.constexpr, N_DCOLS: tl.constexpr, TOP_K: tl.constexpr, OUT_K: tl.constexpr, OUT_SLOTS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, PREC: tl.constexpr, DOWN_TICKET: tl.constexpr, SLOT_DONE: tl.constexpr,
    POLL_NS: tl.constexpr, PREFETCH_LANES: tl.constexpr,
):  # fmt: skip
    """Down program d of the launch: slot d // N_DCOLS (the shared expert's first), H's column block d % N_DCOLS.
    PREFETCH_LANES: 32 x the launch's warps, or 0 for no prefetch."""
    slot = (d // N_DCOLS + OUT_K - 1) % OUT_K if OUT_K > TOP_K else d // N_DCOLS
    if PREFETCH_LANES > 0:
        if slot == TOP_K:  # the shared expert: the host's id (the routing may still run)
            e0 = extra_id.to(tl.int64)
        else:  # the routing's last program writes the slot's word (expert + 1) beside the flag
            word = tl.load(SYNC + 3 + slot, volatile=True)
            while word == 0:
                backoff(POLL_NS)
                word = tl.load(SYNC + 3 + slot, volatile=True)
            e0 = (word - 1).to(tl.int64)
        row0 = (d % N_DCOLS) * BLOCK_N
        rows = tl.minimum(H - row0, BLOCK_N)
        esz: tl.constexpr = W2.dtype.element_ty.primitive_bitwidth // 8
        first = W2 + e0 * stride_w2e + row0.to(tl.int64) * stride_w2n
        nbytes = ((rows - 1).to(tl.int64) * stride_w2n + INTER) * esz // 16 * 16
        prefetch_span_to_l2(first.to(tl.pointer_type(tl.uint8)), nbytes, PREFETCH_LANES)
    wait_count(SYNC + SLOT_DONE + slot, N_COLS, POLL_NS)  # the slot's rows (and its routing)
    tl.debug_barrier()
    if PREFETCH_LANES > 0:  # known before the wait
        e = e0.to(tl.int32)
    elif slot == TOP_K:
        e = extra_id.to(tl.int32)
    else:
        e = tl.load(ID_OUT + slot, cache_modifier=".cg").to(tl.int32)
    down_rows(
        A, W2, Y, e, slot, slot + 1, d % N_DCOLS, H, INTER, stride_a, stride_w2e, stride_w2n, stride_y,
        BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PREC, ".cg",
    )  # fmt: skip
    # every thread's stores of Y come before the ticket's release (the one-thread atomic after the barrier)
    tl.debug_barrier()
    ticket = tl.atomic_add(SYNC + DOWN_TICKET, 1, sem="acq_rel", scope="gpu")
    if ticket == OUT_K * N_DCOLS - 1:  # the last down program: every expert output and the routing are stored
        tl.debug_barrier()
        combine_add_norm_row(
            Y, ID_OUT, W_OUT, RESIDUAL, NORM_W, OUT, RES_OUT, 0, H, eps, stride_y, 0, 0, 0, OUT_K, True,
            BLOCK_H, ".cg",
        )  # fmt: skip
        slots = tl.arange(0, OUT_SLOTS)
        tl.atomic_xchg(SYNC + SLOT_DONE + slots, 0, mask=slots < OUT_K, sem="relaxed", scope="gpu")
        if PREFETCH_LANES > 0:  # the routed slots' words, read by no one after this
            tl.atomic_xchg(SYNC + 3 + slots, 0, mask=slots < TOP_K, sem="relaxed", scope="gpu")
        tl.atomic_xchg(SYNC + DOWN_TICKET, 0, sem="relaxed", scope="gpu")


__all__ = ["POLL_NS_ENV", "PREFETCH_ENV", "DownNorm", "backoff", "block_down_program", "wait_count", "wait_options"]
