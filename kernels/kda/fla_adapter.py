"""KDA through fla-core 0.6.0: with recurrent_launch.py, the only module that touches fla. Contract: naive.py.

- ``chunk_kda_varlen``: prefill / chunked prefill of a varlen batch (chunked WY form, 64-token chunks),
  from per-sequence fp32 initial states, optionally returning the chunk-boundary states.
- ``fused_recurrent_kda_slots``: decode and spec verify, reading and writing the fp32 state pool in place
  through slot indices. It launches fla's ``fused_recurrent_kda_fwd_kernel`` through
  kernels/kda/recurrent_launch.py (the arguments of fla's ``fused_recurrent_kda_fwd``, with a tunable tile),
  which is **not** public API; its slot contract is pinned by tests/kernels/test_kda_fla.py.

fla is imported inside the functions, so the CPU engine (and any process that blocks fla, like the HF
oracle tests) never imports it. Both paths L2-normalise q and k in the kernel (eps 1e-6 inside the sqrt)
and scale q by K^-1/2, like the naive reference; g is the activated log-decay, beta the post-sigmoid beta.

Layouts (flat varlen, as ForwardBatch): q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; states [*, H, K, V] fp32.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from kernels.fla_chunks import CHUNK, ChunkLayout, chunk_layout
from kernels.kda.recurrent_launch import RecurrentTile, launch_fused_recurrent_kda, tile_for

FLA_VERSION = "0.6.0"
KDA_CHUNK = CHUNK  # chunk_kda's chunk size: its intermediate states sit every 64 tokens of a sequence


def fla_available() -> bool:
    """True when fla-core can be imported (it may be blocked on purpose, e.g. in the HF-parity tests)."""
    try:
        return importlib.util.find_spec("fla") is not None
    except (ImportError, ValueError):
        return False


def _check_qkv(q, k, v, g, beta) -> None:
    if q.ndim != 3 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must be [T, H, K] of one shape, got {q.shape}, {k.shape}, {g.shape}")
    if v.ndim != 3 or v.shape[:2] != q.shape[:2] or beta.shape != q.shape[:2]:
        raise ValueError(f"v must be [T, H, V] and beta [T, H] for q {tuple(q.shape)}, got {v.shape}, {beta.shape}")


def _flat(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x.contiguous()[None] for x in xs]


def chunk_kda_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: Sequence[int] | torch.Tensor | ChunkLayout,
    return_intermediate_states: bool = False,
    qk_normalized: bool = False,
    gate: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Chunked KDA over N sequences packed along T (CUDA only: fla's chunk kernels fail under the interpreter).

    Args:
        q, k, g: [T, H, K]; v: [T, H, V]; beta: [T, H].
        initial_state: [N, H, K, V] fp32, not modified; None: zeros (every sequence's first chunk).
        cu_seqlens: N+1 offsets, or their ``chunk_layout`` (built once per step: the KDA layers share it).
        return_intermediate_states: also return fla's chunk-boundary states.
        qk_normalized: q and k are already L2-normed (kernels/short_conv/planes.py): no ``l2norm_fwd`` here.
        gate: (A_log [H], dt_bias [H*K]): g is the raw gate projection [T, H, K], and fla applies the gate
            (``kernels.kda.naive.kda_gate``) inside its chunk cumsum kernel (``use_gate_in_kernel``): one pass
            over [T, H, K] instead of a gate kernel then the cumsum.
    Returns:
        o [T, H, V] (v's dtype), final_state [N, H, K, V] fp32, and h [NT, H, K, V] **bf16** or None.
        h[c] is the state entering the c-th 64-token chunk (chunks counted over all sequences in order, each
        sequence starting a new chunk), i.e. for sequence i the state after 64*j of its tokens.
        bench/gpu_kernels_check.py checks that reading against the recurrence.

    Calls fla's ``chunk_kda_fwd`` (the forward under ``chunk_kda``'s autograd function) with the layout's
    tables: ``chunk_kda`` adds host work per call (dispatch, input guard, autocast, ``torch.compiler.disable``,
    autograd) and rebuilds its chunk table (~12 small device kernels with ``use_graph``); an 8k prefill is
    host-bound (bench/prefill_host.py). Same kernels, same arguments, bit for bit (tests/kernels/test_kda_fla.py
    on CUDA): q and k L2-normalised by fla's ``l2norm_fwd`` (eps 1e-6), scale K^-1/2, fp32 g.
    """
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.kda.chunk_fwd import chunk_kda_fwd

    _check_qkv(q, k, v, g, beta)
    layout = cu_seqlens if isinstance(cu_seqlens, ChunkLayout) else None
    if layout is None:
        cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        layout = chunk_layout(cu, q.device)
    n = layout.num_seqs
    if initial_state is not None:
        if initial_state.dtype != torch.float32:
            raise ValueError(f"initial_state must be fp32 (fla asserts it), got {initial_state.dtype}")
        if initial_state.shape != (n, q.shape[1], q.shape[2], v.shape[2]):
            raise ValueError(f"initial_state must be [{n}, H, K, V], got {tuple(initial_state.shape)}")
        initial_state = initial_state.contiguous()
    if int(layout.cu_cpu[-1]) != q.shape[0]:
        raise ValueError(f"cu_seqlens must run from 0 to T={q.shape[0]}, got {layout.cu_cpu.tolist()}")
    q_, k_, v_, g_, b_ = _flat(q, k, v, g if gate is not None else g.float(), beta)
    fused_gate = {} if gate is None else {"use_gate_in_kernel": True, "A_log": gate[0].reshape(-1), "dt_bias": gate[1]}
    if not qk_normalized:
        q_, _ = l2norm_fwd(q_)
        k_, _ = l2norm_fwd(k_)
    with torch.inference_mode():
        o, final, *_, h, _ = chunk_kda_fwd(
            q=q_,
            k=k_,
            v=v_,
            g=g_,
            beta=b_,
            scale=q.shape[2] ** -0.5,
            initial_state=initial_state,
            output_final_state=True,
            cu_seqlens=layout.cu,
            cu_seqlens_cpu=layout.cu_cpu,
            chunk_indices=layout.chunk_indices,
            chunk_offsets=layout.chunk_offsets,
            chunk_size=KDA_CHUNK,
            return_intermediate_states=return_intermediate_states,
            **fused_gate,
        )
    o = o[0].to(v.dtype)
    if return_intermediate_states:
        return o, final, h[0][: layout.num_chunks]
    return o, final, None


def fused_recurrent_kda_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    tile: RecurrentTile | None = None,
    gate: tuple[torch.Tensor, torch.Tensor] | None = None,
    beta_logits: bool = False,
) -> torch.Tensor:
    """Token-by-token KDA against a slot pool, in place (decode and speculative verify).

    Args:
        q, k, g: [T, H, K]; v: [T, H, V]; beta: [T, H].
        state_pool: [num_slots, H, K, V] fp32, read and written in place.
        ssm_state_indices:
            1-D [N] (decode): sequence n is the single token n (T == N); reads and writes slot idx[n].
            2-D [N, L] (spec verify): sequence n has up to L tokens (``cu_seqlens`` [N+1] when lengths differ,
            else T == N*L). Its initial state is slot ``idx[n, num_accepted_tokens[n] - 1]`` (``idx[n, 0]`` when
            num_accepted_tokens is None); the state after its token t goes to slot ``idx[n, t]``.
            Rollback is free: the next step reads the column of its last accepted token.
        num_accepted_tokens: [N] int32, >= 1 (2-D indices only).
        cu_seqlens: [N+1] offsets (2-D indices); zero-length sequences are skipped (padding).
        tile: the kernel's launch tile; None: ``tile_for`` the number of sequences (measured on an H200).
        gate: (A_log [H], dt_bias [H*K]): g is the raw gate projection (any float dtype), and the kernel applies
            the gate (``kernels.kda.naive.kda_gate``, the formula of fla's gate kernel) as it reads g: the gate
            kernel's launch and its fp32 [T, H, K] round trip are gone from the decode step.
        beta_logits: beta holds b_proj's logits and the kernel takes their sigmoid (in fp32), one launch less.
    Returns: o [T, H, V] in v's dtype.
    """
    _check_qkv(q, k, v, g, beta)
    h, kd, vd = q.shape[1], q.shape[2], v.shape[2]
    fused_gate = None
    if gate is not None:
        a_log, dt_bias = (x.reshape(-1) for x in gate)
        if a_log.numel() != h or dt_bias.numel() != h * kd:
            raise ValueError(
                f"gate must be (A_log [{h}], dt_bias [{h * kd}]), got {tuple(gate[0].shape)}, {tuple(gate[1].shape)}"
            )
        fused_gate = (a_log.to(device=q.device).contiguous(), dt_bias.to(device=q.device).contiguous())
    else:
        g = g.float()  # the activated log-decay: fp32 in the kernel's layout
    if state_pool.ndim != 4 or state_pool.shape[1:] != (h, kd, vd) or not state_pool.is_contiguous():
        raise ValueError(f"state_pool must be a contiguous [slots, {h}, {kd}, {vd}], got {tuple(state_pool.shape)}")
    idx = ssm_state_indices.to(device=q.device, dtype=torch.int32).contiguous()
    t = q.shape[0]
    if idx.ndim == 1:
        if idx.shape[0] != t or num_accepted_tokens is not None or cu_seqlens is not None:
            raise ValueError("1-D ssm_state_indices means one token per sequence: [T] indices, no cu_seqlens/accepted")
        q_, k_, v_, g_, b_ = (x.contiguous()[:, None] for x in (q, k, v, g, beta))  # B=N, T=1
        cu = None
    elif idx.ndim == 2:
        n, width = idx.shape
        if cu_seqlens is None:
            if t != n * width:
                raise ValueError(f"without cu_seqlens T must be N*L = {n * width}, got {t}")
            q_, k_, v_, g_, b_ = (x.contiguous().view(n, width, *x.shape[1:]) for x in (q, k, v, g, beta))
            cu = None
        else:
            if cu_seqlens.shape != (n + 1,):
                raise ValueError(f"cu_seqlens must be [{n + 1}], got {tuple(cu_seqlens.shape)}")
            q_, k_, v_, g_, b_ = _flat(q, k, v, g, beta)
            cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
        if num_accepted_tokens is not None:
            if num_accepted_tokens.shape != (n,):
                raise ValueError(f"num_accepted_tokens must be [{n}], got {tuple(num_accepted_tokens.shape)}")
            num_accepted_tokens = num_accepted_tokens.to(device=q.device, dtype=torch.int32).contiguous()
    else:
        raise ValueError(f"ssm_state_indices must be 1-D or 2-D, got {idx.ndim}-D")
    o = launch_fused_recurrent_kda(
        q_,
        k_,
        v_,
        g_,
        b_,
        state_pool,
        idx,
        num_accepted_tokens,
        cu,
        tile or tile_for(idx.shape[0], gate_in_kernel=fused_gate is not None),
        gate=fused_gate,
        beta_sigmoid=beta_logits,
    )
    return o.reshape(t, h, vd)


__all__ = [
    "FLA_VERSION",
    "KDA_CHUNK",
    "ChunkLayout",
    "chunk_kda_varlen",
    "chunk_layout",
    "fla_available",
    "fused_recurrent_kda_slots",
]
