"""How the routed programs of the one-token route + gate-up launch wait for the routing's flag
(kernels/moe/route_gate_up.py), in one of two forms:

- volatile polls (the default): each poll is a plain load past L1; once one sees the flag, an acquire on it
  (``atomic_add(0, sem="acquire")``, which Triton emits as an acquire load), a barrier so every thread is ordered
  after that one, then the expert id's load and a count of the program (an atomic whose result the program waits
  for, since the last one counted puts the flag back);
- acquire polls (``TANDEM_MOE_ROUTE_ACQUIRE_POLL=1``): every thread polls with ``ld.acquire.gpu``, so the load
  that sees the flag is itself the acquire: no atomic and no barrier after it, and the program counts itself
  after its rows are stored, off the path to its first weight load.

Why: a routed program's weights start streaming only after the routing, so every round trip to L2 between
seeing the flag and the first weight load is on the step's critical path, seven times a b1 step. The volatile
form makes three of them (the acquire, the id, the count), the acquire form one (the id). Under
``TRITON_INTERPRET=1`` (no inline PTX) the acquire form is off.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from kernels.env import env_switch
from kernels.triton_utils import is_interpreting


@triton.jit
def load_acquire(ptr):
    """The int32 at ptr, loaded with acquire semantics at GPU scope by every thread (``ld.acquire.gpu``)."""
    word = tl.inline_asm_elementwise(
        "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr + tl.zeros([1], tl.int32)], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip
    return tl.max(word, axis=0)


@triton.jit
def wait_flag(ptr, ACQUIRE_POLL: tl.constexpr):
    """Return once the int32 flag at ptr is non-zero, every thread of the program ordered after the store that
    raised it (a release): by its own acquire load, or by one acquire atomic and a barrier."""
    if ACQUIRE_POLL:
        while load_acquire(ptr) == 0:
            pass
    else:
        while tl.load(ptr, volatile=True) == 0:
            pass
        tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")  # orders the routing's loads after the flag
        tl.debug_barrier()


def acquire_poll(choice: bool | None = None) -> bool:
    """The acquire form, from ``choice`` or ``TANDEM_MOE_ROUTE_ACQUIRE_POLL`` (0 / 1, default 0: not yet timed in
    a step); never under the interpreter."""
    return (acquire_poll_from_env() if choice is None else choice) and not is_interpreting()


@functools.cache
def acquire_poll_from_env() -> bool:
    """``TANDEM_MOE_ROUTE_ACQUIRE_POLL`` read once (a launch a MoE layer reads it)."""
    return env_switch("TANDEM_MOE_ROUTE_ACQUIRE_POLL", False)


__all__ = ["acquire_poll", "acquire_poll_from_env", "load_acquire", "wait_flag"]
