"""KDA across PCP ranks by a state scan: each rank runs the recurrence on one contiguous segment of a
sequence only, and the segments are joined through the state they pass on.

The KDA state update is affine in the state (per head, S [K, V]):

    S_t = (I - beta_t k_t k_t^T) diag(exp g_t) S_{t-1} + beta_t k_t v_t^T      o_t = scale q_t^T S_t

so a segment run from a zero state yields, besides its outputs o0 and final state N, the linear parts
that an initial state S adds:

    final state   M S + N        M [H, K, K]: the product of the segment's transitions
    outputs       o0_t + P_t S   P_t [H, K]: the query carried through the transitions before t

Both come from one run of the chunk kernel itself (fla's ``chunk_kda`` on the GPU, the reference chunk
form on the CPU) with the value widened to ``[v | 0]`` and the initial state ``[0 | I]``: the state's
columns evolve independently, so the V columns give (o0, N) and the K columns (P, M). No kernel of our
own, and the cost is one pass with V + K value columns.

The first rank's segment starts from the true initial state (a prefix-cache hit's, or zero), so it runs
the plain kernel and needs no correction; it takes a larger share of the sequence (``FIRST_WEIGHT``) to
balance the wider passes of the others. The segments' (M, N) are all-gathered and scanned identically on
every rank (the first rank contributes M = 0, N = its final state), so every rank keeps a bit-identical
copy of the state, as the P/D producer and the prefix cache need.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

import torch

ChunkFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
"""The signature of kernels.kda.fla_adapter.chunk_kda_varlen: (q, k, v, g, beta, initial_state,
cu_seqlens) -> (o [T, H, V], final [N, H, K, V] fp32, chunk states or None)."""

SCAN_CHUNK = 64  # KDA's chunk: segments start on chunk boundaries, so no rank pads a chunk it shares
FIRST_WEIGHT = float(os.environ.get("TANDEM_PCP_KDA_FIRST_WEIGHT", "1.4"))
"""The first rank's share of a sequence relative to each other rank's. The others' recurrence pass carries
V + K value columns (~1.6x the work of rank 0's plain pass); the mixer's projections cost the same a row
everywhere. With Kimi-Linear's shapes on the H200 (projections ~2 ms, chunk_kda ~3 ms a layer at 16k)
the loads balance near 1.4. Only speed depends on it; bench/parallel_gpu.py measures the result."""


def segment_bounds(
    length: int, size: int, first_weight: float = FIRST_WEIGHT, chunk: int = SCAN_CHUNK
) -> list[tuple[int, int]]:
    """[lo, hi) of each rank's contiguous segment of a ``length``-token chunk of a sequence, cut on
    ``chunk`` boundaries; rank 0 first and ``first_weight`` times longer than the others (up to rounding).
    Chunks no longer than one KDA chunk are not split: rank 0 runs them whole."""
    if length <= chunk or size == 1:
        return [(0, length)] + [(length, length)] * (size - 1)
    total = first_weight + size - 1
    cuts = [0]
    for r in range(1, size):
        cut = round(length * (first_weight + r - 1) / total / chunk) * chunk
        cuts.append(min(max(cut, cuts[-1], chunk), length))  # rank 0 runs at least one chunk
    cuts.append(length)
    return list(itertools.pairwise(cuts))


def linear_segments(
    chunk_fn: ChunkFn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Segments (packed by ``cu_seqlens``) from a zero state, with their linear parts. q, k, g [T, H, K];
    v [T, H, V]; beta [T, H]. Returns o0 [T, H, V], P [T, H, K] (the kernel's output dtype), M [N, H, K, K]
    and N [N, H, K, V] fp32: with initial state S, o = o0 + P S and the final state is M S + N."""
    t, h, kd = k.shape
    vd = v.shape[-1]
    n = len(cu_seqlens) - 1
    widened = torch.cat([v, v.new_zeros(t, h, kd)], dim=-1)
    init = torch.zeros(n, h, kd, vd + kd, dtype=torch.float32, device=v.device)
    init[..., vd:] = torch.eye(kd, device=v.device)
    o, final, _ = chunk_fn(q, k, widened, g, beta, init, cu_seqlens)
    return o[..., :vd], o[..., vd:], final[..., vd:], final[..., :vd]


def apply_initial_state(o0: torch.Tensor, p: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """o0 [T, H, V] + P [T, H, K] S [H, K, V], in fp32."""
    return o0.float() + torch.einsum("thk,hkv->thv", p.float(), s)


def scan_states(initial: torch.Tensor, trans: torch.Tensor, final0: torch.Tensor) -> torch.Tensor:
    """Segment start states from the segments' (M, N) in order: initial [H, K, V], trans [R, H, K, K],
    final0 [R, H, K, V] -> [R + 1, H, K, V] (the last is the state after every segment)."""
    out = [initial]
    for m, nn in zip(trans, final0, strict=True):
        out.append(m @ out[-1] + nn)
    return torch.stack(out)
