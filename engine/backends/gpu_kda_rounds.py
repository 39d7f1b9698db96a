"""A GPU KDA step's state-cache work around the kernels (engine/backends/gpu_kda.py): the recurrence over the
step's decode rows (fla's fused recurrent kernel on the slot pool) and its prefill rounds (``chunk_fn``, fla's
chunk_kda by default, from gathered initial states, final states scattered back), with the rung checkpoints'
copies; and the short conv's rung windows. The plan of all of it is the step's ``KDAStep`` / ``KDADecodeStep``
(engine/backends/kda_step.py, engine/backends/gpu_static.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.backends.gpu_static import KDADecodeStep
from engine.backends.kda_step import KDAStep
from kernels.kda.fla_adapter import fused_recurrent_kda_slots


def run_recurrence(
    chunk_fn: Callable,
    m: KDAStep | KDADecodeStep,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_cache: torch.Tensor,
    qk_normalized: bool = False,
    gate: tuple[torch.Tensor, torch.Tensor] | None = None,
    beta_logits: bool = False,
) -> torch.Tensor:
    """The KDA recurrence of step ``m`` -> o [T, H, V]; the arguments as ``GPUKDABackend.recurrence``'s."""
    prefill_only = isinstance(m, KDAStep) and m.dec_slots is None
    if qk_normalized and not prefill_only:
        raise ValueError("qk_normalized is for prefill-only steps: the decode kernel norms q and k itself")
    if (gate is not None and not (prefill_only or m.all_decode)) or (beta_logits and not m.all_decode):
        raise ValueError("a raw gate is for prefill-only or all-decode steps, beta logits for all-decode steps")
    if m.fresh is not None:
        state_cache.index_fill_(0, m.fresh, 0.0)  # not `[idx] = 0.0`: that uploads the scalar (a sync)
    for slot, dst in m.pre_copies:
        state_cache[dst] = state_cache[slot]
    # o stays in fla's output dtype (v's): the model casts it to its own dtype (v's) next, so widening it
    # to fp32 here was a lossless round trip of two full-size copies per layer
    if m.all_decode:
        out = fused_recurrent_kda_slots(q, k, v, g, beta, state_cache, m.dec_slots, gate=gate, beta_logits=beta_logits)
        for slot, dst in m.dec_copies:
            state_cache[dst] = state_cache[slot]
        return out
    out = None if m.rows_are_all else torch.empty(*v.shape, dtype=v.dtype, device=v.device)
    if m.dec_rows is not None:
        sel = (x[m.dec_rows] for x in (q, k, v, g, beta))
        out[m.dec_rows] = fused_recurrent_kda_slots(*sel, state_cache, m.dec_slots)
        for slot, dst in m.dec_copies:
            state_cache[dst] = state_cache[slot]
    extra = ({"qk_normalized": True} if qk_normalized else {}) | ({"gate": gate} if gate is not None else {})
    for rows, slots, cu, copies, needs_h in m.rounds:
        sel = (q, k, v, g, beta) if m.rows_are_all else (x[rows] for x in (q, k, v, g, beta))
        o, final, h = chunk_fn(*sel, state_cache[slots], cu, return_intermediate_states=needs_h, **extra)
        state_cache[slots] = final.to(state_cache.dtype)
        for kind, index, dst in copies:
            state_cache[dst] = (final if kind == "final" else h)[index].to(state_cache.dtype)
        if m.rows_are_all:
            out = o
        else:
            out[rows] = o
    return out


def write_rung_windows(x: torch.Tensor, conv_cache: torch.Tensor, w1: int, m: KDAStep | KDADecodeStep) -> None:
    """Rung windows, before a kernel updates the windows in place: the window after `off` tokens of a chunk
    is the last W-1 columns of [old window | x[:off]^T]."""
    for row0, off, slot, has_init, dst in getattr(m, "conv_cks", ()):
        if off >= w1:
            conv_cache[dst, :, :w1] = x[row0 + off - w1 : row0 + off].t()
        else:
            prev = conv_cache[slot, :, off:w1] if has_init else conv_cache.new_zeros(x.shape[1], w1 - off)
            conv_cache[dst, :, :w1] = torch.cat([prev, x[row0 : row0 + off].t().to(conv_cache.dtype)], dim=-1)


__all__ = ["run_recurrence", "write_rung_windows"]
