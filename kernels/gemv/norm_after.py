"""The residual add + RMSNorm after a one-row projection, run by the projection's last program.

A batch-1 decode step ran each post-attention norm as its own one-program launch right after the attention's
output projection (8 a step on the Kimi mid shape, ~2.6 us each on the H100: launch latency, docs/PERFORMANCE.md,
twenty-ninth session's kernel table). The projection's programs each own a few output columns; once a program
has stored its columns it takes a ticket (an ``atomic_add``, acquire-release at GPU scope, after a barrier so all
its threads' stores precede it), and the program that draws the last ticket has seen every column: it adds the
residual, stores the sum as the new residual and writes the norm, then puts the ticket back to 0 for the next
launch (kernels/moe/route_fused.py does the same for the router's top-k).

Numerics are ``add_rms_norm_reference`` on the projection's output as the projection stores it (rounded to its
dtype): the sum in fp32, stored in the residual's dtype, normalised in fp32. Contract: ``naive_gemv_norm_after``
(kernels/gemv/naive.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_utils import next_pow2


@dataclass(frozen=True)
class NormAfter:
    """What follows the projection: ``(rms_norm(residual + y) * weight, residual + y)`` is wanted instead of y.
    ticket: an int32 [1] at 0 on y's device (``kernels.triton_utils.LaunchTicket`` makes one per device), left at
    0; launches that share it must not overlap (one stream)."""

    residual: torch.Tensor  # [1, N]
    weight: torch.Tensor  # [N]
    eps: float
    ticket: torch.Tensor


def norm_after_outputs(
    after: NormAfter, y: torch.Tensor, name: str
) -> tuple[torch.Tensor, torch.Tensor, dict[str, object]]:
    """Check ``after`` against the projection's output y [1, N]; return (the norm's output, the new residual, the
    kernel's extra arguments)."""
    n = y.shape[1]
    r, w, t = after.residual, after.weight, after.ticket
    if r.shape != (1, n) or r.stride(1) != 1 or w.shape != (n,):
        raise ValueError(
            f"{name}: the residual must be [1, {n}] with a unit column stride and the norm's weight [{n}]; got "
            f"{tuple(r.shape)} and {tuple(w.shape)}"
        )
    if t.shape != (1,) or t.dtype != torch.int32:
        raise ValueError(f"{name}: the ticket must be an int32 [1], got {t.dtype} {tuple(t.shape)}")
    for what, tensor in (("residual", r), ("norm weight", w), ("ticket", t)):
        if tensor.device != y.device:
            raise ValueError(f"{name}: the {what} is on {tensor.device}, the projection on {y.device}")
    out = torch.empty_like(y)
    res_out = torch.empty(1, n, dtype=r.dtype, device=y.device)
    args = dict(RES=r, NW=w.contiguous(), OUT=out, RES_OUT=res_out, TICKET=t, eps=float(after.eps))
    args["BLOCK_H"] = next_pow2(n)
    return out, res_out, args


@triton.jit
def norm_after_last_program(Y, RES, NW, OUT, RES_OUT, TICKET, N, eps, BLOCK_H: tl.constexpr):
    """Called by every program of a one-row projection after it stored its columns of Y [N]; the last one runs the
    residual add and the norm over all N columns (BLOCK_H >= N)."""
    # every thread's stores of Y come before the ticket's release (the one-thread atomic after the barrier)
    tl.debug_barrier()
    ticket = tl.atomic_add(TICKET, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:  # every column is stored
        tl.debug_barrier()
        cols = tl.arange(0, BLOCK_H)
        m = cols < N
        # past L1: the other programs' columns were written by other SMs
        x = tl.load(Y + cols, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        x += tl.load(RES + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(RES_OUT + cols, x.to(RES_OUT.dtype.element_ty), mask=m)
        rstd = 1 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)  # x is 0 past N
        nw = tl.load(NW + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(OUT + cols, (x * rstd * nw).to(OUT.dtype.element_ty), mask=m)
        tl.atomic_xchg(TICKET, 0, sem="relaxed", scope="gpu")  # no program of this launch touches it again


def no_norm_after_args(y: torch.Tensor) -> dict[str, object]:
    """Placeholder arguments for a launch without the norm (never read: the kernel's NORM_AFTER is off)."""
    return dict(RES=y, NW=y, OUT=y, RES_OUT=y, TICKET=y, eps=0.0, BLOCK_H=1)


__all__ = ["NormAfter", "no_norm_after_args", "norm_after_last_program", "norm_after_outputs"]
