"""Reference Kimi Delta Attention (KDA) in plain PyTorch, fp32.

Recurrence per head, state S [K, V] (fla kernel order, see docs/ARCHITECTURE.md):
    S <- Diag(exp g_t) S ;  u_t = beta_t (v_t - S^T k_t) ;  S <- S + k_t u_t^T ;  o_t = S^T q_t
with q, k L2-normalised (eps 1e-6 inside the sqrt, as fla) and q scaled by K^-1/2.

Shapes: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; state [B, H, K, V] (fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # fla adds eps under the sqrt rather than clamping like F.normalize; match it exactly.
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_gate(g_raw: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Log-space channel decay: g = -exp(A_log[h]) * softplus(g_raw + dt_bias). Returns [..., H, K] fp32."""
    g = (g_raw.float() + dt_bias.float()).unflatten(-1, (-1, head_dim))
    # softplus with the same overflow guard (and formula) as the reference implementations
    g_softplus = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
    return -torch.exp(a_log.float().reshape(-1, 1)) * g_softplus


def _prepare(q, k, v, g, beta, use_qk_l2norm: bool):
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * (q.shape[-1] ** -0.5), k, v, g, beta


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA. Returns (o [B, T, H, V] fp32, final state [B, H, K, V] fp32)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    b, t, h, kd = k.shape
    state = (
        torch.zeros(b, h, kd, v.shape[-1], dtype=torch.float32, device=v.device)
        if initial_state is None
        else initial_state.float().clone()
    )
    o = torch.empty_like(v)
    for i in range(t):
        state = state * g[:, i].exp()[..., None]
        kv_mem = (state * k[:, i, ..., None]).sum(dim=-2)
        delta = (v[:, i] - kv_mem) * beta[:, i, :, None]
        state = state + k[:, i, ..., None] * delta[..., None, :]
        o[:, i] = (state * q[:, i, ..., None]).sum(dim=-2)
    return o, state


def naive_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY-form) KDA: the same result as the recurrence, vectorised inside each chunk.

    Used for prefill: O(T / chunk) Python steps instead of O(T).
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    b, t, h, kd = k.shape
    vd = v.shape[-1]
    pad = (chunk_size - t % chunk_size) % chunk_size
    # [B, H, T, D] then pad the time axis
    q, k, v, g = (F.pad(x.transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v, g))
    beta = F.pad(beta.transpose(1, 2), (0, pad))
    n = (t + pad) // chunk_size
    q, k, v, g = (x.reshape(b, h, n, chunk_size, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(b, h, n, chunk_size)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]

    g = g.cumsum(dim=-2)
    incl = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device))
    strict = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device), 1)
    # decay[i, j, :] = exp(G_i - G_j) for j <= i
    decay = (g[..., :, None, :] - g[..., None, :, :]).masked_fill(strict[..., None], float("-inf")).exp()
    a = -(k_beta[..., :, None, :] * k[..., None, :, :] * decay).sum(-1).masked_fill(incl, 0)
    for i in range(1, chunk_size):  # forward substitution: (I - A)^-1 row by row
        row = a[..., i, :i].clone()
        a[..., i, :i] = row + (row[..., None] * a[..., :i, :i].clone()).sum(-2)
    a = a + torch.eye(chunk_size, dtype=a.dtype, device=a.device)
    u = a @ v_beta
    w = a @ (k_beta * g.exp())

    state = (
        torch.zeros(b, h, kd, vd, dtype=torch.float32, device=q.device)
        if initial_state is None
        else initial_state.float().clone()
    )
    o = torch.zeros_like(u)
    for i in range(n):
        q_i, k_i, g_i = q[:, :, i], k[:, :, i], g[:, :, i]
        intra = (q_i[..., :, None, :] * k_i[..., None, :, :] * decay[:, :, i]).sum(-1).masked_fill(strict, 0)
        v_new = u[:, :, i] - w[:, :, i] @ state
        o[:, :, i] = (q_i * g_i.exp()) @ state + intra @ v_new
        state = state * g_i[:, :, -1].exp()[..., None] + (k_i * (g_i[:, :, -1:] - g_i).exp()).transpose(-1, -2) @ v_new
    o = o.reshape(b, h, n * chunk_size, vd)[:, :, :t].transpose(1, 2).contiguous()
    return o, state


def naive_chunk_kda_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    cu_seqlens,
    return_intermediate_states: bool = False,
    qk_normalized: bool = False,
    gate: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``naive_chunk_kda`` with the signature and chunk-boundary-state convention of
    ``kernels.kda.fla_adapter.chunk_kda_varlen`` (packed [T, H, *] inputs, N sequences by ``cu_seqlens``).
    Returns o [T, H, V] fp32, final [N, H, K, V] fp32, and the state entering every 64-token chunk or None.
    ``cu_seqlens``: N+1 offsets or a ``ChunkLayout`` (its host offsets are read); ``qk_normalized``: q and k
    come L2-normed, not normed again; ``gate`` (A_log, dt_bias): g is the raw gate projection [T, H, K], gated
    here first (``kda_gate``)."""
    if gate is not None:
        g = kda_gate(g.flatten(-2), gate[0], gate[1], g.shape[-1])
    outs, finals, states = [], [], []
    bounds = [int(x) for x in getattr(cu_seqlens, "cu_cpu", cu_seqlens)]
    for i in range(len(bounds) - 1):
        a, b = bounds[i], bounds[i + 1]
        s = initial_state[i : i + 1]
        pieces = range(a, b, 64) if return_intermediate_states else [a]
        for c0 in pieces:
            c1 = min(c0 + 64, b) if return_intermediate_states else b
            states.append(s[0])
            o, s = naive_chunk_kda(*(x[None, c0:c1] for x in (q, k, v, g, beta)), s, use_qk_l2norm=not qk_normalized)
            outs.append(o[0])
        finals.append(s[0])
    h = torch.stack(states) if return_intermediate_states else None
    o = torch.cat(outs) if outs else v.new_zeros(0, *v.shape[1:], dtype=torch.float32)
    return o, torch.stack(finals), h
