"""KDA across PCP ranks by a state scan: each rank runs the recurrence on one contiguous segment of a
sequence only, and the segments are joined through the state they pass on.

The KDA state update is affine in the state (per head, S [K, V]):

    S_t = (I - beta_t k_t k_t^T) diag(exp g_t) S_{t-1} + beta_t k_t v_t^T

so a segment run from a zero state yields, besides its outputs o0 and final state N, the linear
parts that an initial state S would add:

    final state   M S + N               M [H, K, K]: the product of the segment's transitions
    outputs       o0_t + P_t S          P_t [H, K]: the query after the transitions before t

In the chunked (WY) form each 64-token chunk contributes A = diag(exp g_last) - Kd^T W to M and
Q~ = q exp(g) - intra W to P (the same quantities the chunk kernel already computes), so M and P cost
O(K^2) per token and head: the recurrence's own order. The scan over ranks is then pcp tiny matrix
products, done identically on every rank (so every rank keeps a bit-identical copy of the state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.kda.naive import _prepare


def segment_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One segment from a zero state. q, k, g [T, H, K]; v [T, H, V]; beta [T, H] (as the recurrence
    backend gets them: un-normalised q / k, log-decay g). Returns o0 [T, H, V], P [T, H, K],
    M [H, K, K], N [H, K, V], all fp32: with initial state S, o = o0 + P S and the final state is M S + N."""
    q, k, v, g, beta = _prepare(q[None], k[None], v[None], g[None], beta[None], True)
    _, t, h, kd = k.shape
    vd = v.shape[-1]
    pad = (chunk_size - t % chunk_size) % chunk_size  # padded rows: k = beta = g = 0, an identity step
    q, k, v, g = (F.pad(x[0].transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v, g))  # [H, T', D]
    beta = F.pad(beta[0].transpose(0, 1), (0, pad))
    n = (t + pad) // chunk_size
    q, k, v, g = (x.reshape(h, n, chunk_size, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(h, n, chunk_size)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    g = g.cumsum(dim=-2)
    incl = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device))
    strict = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device), 1)
    decay = (g[..., :, None, :] - g[..., None, :, :]).masked_fill(strict[..., None], float("-inf")).exp()
    a = -(k_beta[..., :, None, :] * k[..., None, :, :] * decay).sum(-1).masked_fill(incl, 0)
    for i in range(1, chunk_size):  # (I - A)^-1 by forward substitution, as the chunk kernel
        row = a[..., i, :i].clone()
        a[..., i, :i] = row + (row[..., None] * a[..., :i, :i].clone()).sum(-2)
    a = a + torch.eye(chunk_size, dtype=a.dtype, device=a.device)
    u, w = a @ v_beta, a @ (k_beta * g.exp())

    state = q.new_zeros(h, kd, vd)  # N so far
    trans = torch.eye(kd, dtype=q.dtype, device=q.device).expand(h, kd, kd).clone()  # M so far
    o, p = torch.zeros_like(u), q.new_zeros(h, n, chunk_size, kd)
    for i in range(n):
        q_i, k_i, g_i, w_i = q[:, i], k[:, i], g[:, i], w[:, i]
        intra = (q_i[..., :, None, :] * k_i[..., None, :, :] * decay[:, i]).sum(-1).masked_fill(strict, 0)
        q_tilde = q_i * g_i.exp() - intra @ w_i  # what an initial state adds to this chunk's outputs
        o[:, i] = q_tilde @ state + intra @ u[:, i]
        p[:, i] = q_tilde @ trans
        k_dec = k_i * (g_i[:, -1:] - g_i).exp()
        step = torch.diag_embed(g_i[:, -1].exp()) - k_dec.transpose(-1, -2) @ w_i  # A of this chunk
        state = step @ state + k_dec.transpose(-1, -2) @ u[:, i]
        trans = step @ trans
    o = o.reshape(h, n * chunk_size, vd)[:, :t].transpose(0, 1)
    p = p.reshape(h, n * chunk_size, kd)[:, :t].transpose(0, 1)
    return o, p, trans, state


def apply_initial_state(o0: torch.Tensor, p: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """o0 [T, H, V] + P [T, H, K] S [H, K, V]."""
    return o0 + torch.einsum("thk,hkv->thv", p, s)


def scan_states(initial: torch.Tensor, trans: torch.Tensor, final0: torch.Tensor) -> torch.Tensor:
    """Segment start states from the segments' (M, N) in order: initial [H, K, V], trans [R, H, K, K],
    final0 [R, H, K, V] -> [R + 1, H, K, V] (the last is the state after every segment)."""
    out = [initial]
    for m, nn in zip(trans, final0, strict=True):
        out.append(m @ out[-1] + nn)
    return torch.stack(out)
