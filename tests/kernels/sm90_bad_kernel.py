"""A kernel that runs under the interpreter and does not compile: test_sm90_compile.py checks that the compile check
reports it. The twenty-sixth session's MoE pair-row helper had this shape: a constexpr branch that returns int32
values before a return of int64 loads (Triton types both returns; the interpreter runs only the branch taken)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _first_of(ENDS, IDS, PAIR_ROWS: tl.constexpr):
    slot = tl.program_id(0)
    if PAIR_ROWS:
        return tl.load(IDS + slot).to(tl.int32), slot
    return slot, tl.load(ENDS + slot)


@triton.jit
def returns_two_types(
    X, TOKEN, ENDS, IDS, POS, W13, A, H, INTER, up_offset, stride_x, stride_we, stride_wn, stride_a,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
    PREC: tl.constexpr, COMPACT: tl.constexpr, PAIR_ROWS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """_gate_up_kernel's parameters, so a recorded launch of it can be pointed here."""
    e, start = _first_of(ENDS, IDS, PAIR_ROWS)
    tl.store(A + start, e.to(A.dtype.element_ty))
