"""fla-core's fused recurrent KDA kernel, launched with our own tile (decode and spec verify on the slot pool).

fla's wrapper ``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd`` fixes the tile (BV=32, 4 warps, 2 stages),
so it cannot be tuned per GPU. ``launch_fused_recurrent_kda`` launches ``fused_recurrent_kda_fwd_kernel`` itself
with exactly the arguments that wrapper passes for the in-place slot-pool case, only with ``RecurrentTile``'s
BV / num_warps / num_stages. The kernel is **not** public API: its signature is pinned to fla-core 0.6.0 and
tests/kernels/test_kda_fla.py checks every tile against fla's wrapper. (fla's backend dispatch can only swap the
wrapper for an Ascend NPU implementation, which Tandem does not run.)

The kernel masks the V tile (``o_v < V``), so a BV larger than V is correct (idle lanes), just wasteful.
fla and triton are imported inside the function: importing this module never needs either.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RecurrentTile:
    """Launch parameters of the recurrent kernel: V columns per program, warps, software-pipeline stages
    (``num_stages`` is both the compile option and the kernel's own constexpr for its token loop)."""

    bv: int = 32
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name, ok, want in (
            ("bv", lambda x: 8 <= x <= 128 and x & (x - 1) == 0, "a power of two in 8..128"),
            ("num_warps", lambda x: x in (1, 2, 4, 8), "one of 1, 2, 4, 8"),
            ("num_stages", lambda x: 1 <= x <= 4, "in 1..4"),
        ):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or not ok(x):
                raise ValueError(f"RecurrentTile.{name} must be {want}, got {x!r}")


DEFAULT_RECURRENT_TILE = RecurrentTile()  # fla-core 0.6.0's own choice


@functools.cache  # per launch on the eager decode path: build (and validate) each tile once
def tile_for(num_seqs: int, gate_in_kernel: bool = False) -> RecurrentTile:
    """The tile for a step of ``num_seqs`` sequences, from ``python -m bench.kda_recurrent_sweep`` on an H200
    (32 heads x 128 x 128, docs/PERFORMANCE.md): 2 warps beat fla's 4 at every batch (N=16: 24.2 vs 27.2 us),
    and 64 columns per program win once the grid is large (N=64: 75.4 vs 83.7 us, 85 % of copy bandwidth) —
    except with the gate applied in the kernel, where 32 columns stay ahead (N=64: 81.0 vs 85.9 us,
    ``python -m bench.kda_decode_gate``)."""
    return RecurrentTile(bv=64 if num_seqs >= 48 and not gate_in_kernel else 32, num_warps=2, num_stages=2)


def launch_fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    ssm_state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    tile: RecurrentTile = DEFAULT_RECURRENT_TILE,
    use_qk_l2norm_in_kernel: bool = True,
    out: torch.Tensor | None = None,
    gate: tuple[torch.Tensor, torch.Tensor] | None = None,
    beta_sigmoid: bool = False,
) -> torch.Tensor:
    """``fused_recurrent_kda_fwd(..., initial_state=state_pool, inplace_final_state=True, ...)`` with ``tile``.

    Inputs in fla's layout (kernels/kda/fla_adapter.py builds them and validates shapes): q, k [B, T, H, K];
    v [B, T, HV, V]; g [B, T, HV, K] fp32 log-decay; beta [B, T, HV] post-sigmoid; B = 1 when ``cu_seqlens``
    [N+1] is given. state_pool [slots, HV, K, V] fp32, updated in place through ``ssm_state_indices``
    ([N] or [N, L], last dim contiguous). scale = K^-1/2.
    gate: (A_log [HV] fp32, dt_bias [HV*K]): g is the raw gate projection and the kernel applies the gate
    (``USE_GATE_IN_KERNEL``: ``-exp(A_log) * softplus(g + dt_bias)``, fla's gate kernel's formula).
    beta_sigmoid: beta holds the logits and the kernel takes their sigmoid (``APPLY_BETA_SIGMOID``).
    ``out`` (optional, like v) receives the output; else one is allocated: uninitialised without
    ``cu_seqlens`` (every program stores its V tile for every token of its sequence: no row is left unwritten,
    and fla's zero fill would be one more launch a decode layer), zeroed with them (rows past the last offset).
    Returns o [B, T, HV, V] in v's dtype.
    """
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd_kernel

    from kernels.triton_utils import next_pow2  # imports triton, as fla just did

    if not isinstance(tile, RecurrentTile):
        raise TypeError(f"tile must be a RecurrentTile, got {type(tile).__name__}")
    idx = ssm_state_indices
    if idx.ndim not in (1, 2) or idx.stride(-1) != 1:
        raise ValueError("ssm_state_indices must be 1-D or 2-D with a contiguous last dim (the kernel ignores it)")
    b, t, h, kd = k.shape
    hv, vd = v.shape[2], v.shape[3]
    n = b if cu_seqlens is None else len(cu_seqlens) - 1
    if out is None:
        out = torch.empty_like(v) if cu_seqlens is None else torch.zeros_like(v)
    elif out.shape != v.shape or out.dtype != v.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(v.shape)} {v.dtype}, got {tuple(out.shape)} {out.dtype}")
    stride_seq, stride_tok = (idx.stride(0), 1) if idx.ndim == 1 else idx.stride()
    grid = (-(-vd // tile.bv) * n * hv,)
    fused_recurrent_kda_fwd_kernel[grid](
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        A_log=None if gate is None else gate[0],
        dt_bias=None if gate is None else gate[1],
        o=out,
        h0=state_pool,
        ht=state_pool,
        cu_seqlens=cu_seqlens,
        ssm_state_indices=idx,
        num_accepted_tokens=num_accepted_tokens,
        lower_bound=None,
        scale=kd**-0.5,
        N=n,
        T=t,
        H=h,
        HV=hv,
        K=kd,
        V=vd,
        BK=next_pow2(kd),
        BV=tile.bv,
        stride_init_state_token=state_pool.stride(0),
        stride_final_state_token=state_pool.stride(0),
        stride_indices_seq=stride_seq,
        stride_indices_tok=stride_tok,
        IS_BETA_HEADWISE=beta.ndim == v.ndim,
        USE_QK_L2NORM_IN_KERNEL=use_qk_l2norm_in_kernel,
        INPLACE_FINAL_STATE=True,
        USE_GATE_IN_KERNEL=gate is not None,
        APPLY_BETA_SIGMOID=beta_sigmoid,
        ALLOW_NEG_EIGVAL=False,
        STATE_V_FIRST=False,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out


__all__ = ["DEFAULT_RECURRENT_TILE", "RecurrentTile", "launch_fused_recurrent_kda"]
