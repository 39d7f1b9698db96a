"""Causal self-attention of prefill sequences that have no cached prefix, through torch SDPA's cuDNN backend.

Why: MLA's expanded prefill (``mla.mla_expanded``: per-head keys 128 + 64, values 128) is compute-bound, and
on the H200 cuDNN's fused attention (keys built as here) ran it at 516 / 580 TFLOP/s against our Triton
kernel's 317 / 336 at 8k / 32k tokens (1.63x / 1.72x, ``bench/mla_prefill_sdpa.py``, docs/PERFORMANCE.md).
The issue allows torch SDPA where there is no prefix: a sequence whose keys are exactly its own query rows
(first prefill chunk, no prefix-cache hit, consecutive positions), so SDPA's square causal mask is the right
one. Everything else (a prefix in pages, PCP's strided rows, fp32, the CPU) stays on the Triton kernel / the
torch reference.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.env import env_switch

# TANDEM_MLA_PREFILL_SDPA=0 keeps every prefill launch on the Triton kernel (A/B runs).
MLA_PREFILL_SDPA = env_switch("TANDEM_MLA_PREFILL_SDPA", True)


@functools.cache
def _cudnn_runs(dtype: torch.dtype, device: torch.device, d_qk: int, d_v: int) -> bool:
    """One tiny call: this build's cuDNN takes these head dims (it raises for shapes it has no kernel for)."""
    q = torch.zeros(1, 2, 8, d_qk, dtype=dtype, device=device)
    v = torch.zeros(1, 2, 8, d_v, dtype=dtype, device=device)
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, q, v, is_causal=True)
    except RuntimeError:
        return False
    return True


def cudnn_self_attention_usable(dtype: torch.dtype, device: torch.device, d_qk: int, d_v: int) -> bool:
    """Whether ``causal_self_attention`` may take cuDNN here: CUDA, 16-bit, and a probe that ran."""
    if not MLA_PREFILL_SDPA or device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    return torch.backends.cudnn.is_available() and _cudnn_runs(dtype, device, d_qk, d_v)


def causal_self_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: Sequence[int],
    scale: float,
    backend: SDPBackend = SDPBackend.CUDNN_ATTENTION,
) -> torch.Tensor:
    """q / k [T, H, Dqk], v [T, H, Dv] of sequences laid end to end (``seq_lens`` rows each, every row a query
    and a key of its own sequence at consecutive positions) -> [T, H, Dv], each row attending to its
    sequence's rows up to itself. One SDPA call per sequence (prefill batches here are a few long prompts).
    One sequence: SDPA's output as a [T, H, Dv] view (not contiguous: the caller's copy into its own buffer
    is the only one). ``backend``: tests on the CPU pass the math backend."""
    if not (q.shape[:2] == k.shape[:2] == v.shape[:2] and q.shape[2] == k.shape[2]):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be [T, H, D] alike")
    if sum(seq_lens) != q.shape[0] or min(seq_lens, default=1) < 1:
        raise ValueError(f"seq_lens {list(seq_lens)} must be positive and add up to the {q.shape[0]} rows")
    if len(seq_lens) == 1:
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, scale=scale
            )
        return o[0].transpose(0, 1)
    out = v.new_empty(v.shape)
    start = 0
    with sdpa_kernel(backend):
        for n in seq_lens:
            rows = slice(start, start + n)
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None],
                k[rows].transpose(0, 1)[None],
                v[rows].transpose(0, 1)[None],
                is_causal=True,
                scale=scale,
            )
            out[rows] = o[0].transpose(0, 1)
            start += n
    return out


def build_keys_values_weight(
    kv_b_weight: torch.Tensor, num_heads: int, rope: int, nope: int, v_dim: int
) -> torch.Tensor:
    """kv_b [H*(nope+v), R] -> W [H*(nope+rope+v), R+rope] such that latent [T, R+rope] @ W^T is, per head,
    ``k_nope | k_pe | v``: k_pe passes through identity rows (exact: x * 1 plus R zero products).

    Why: SDPA needs each head's key whole (nope + rope). Built as the GEMM's own output layout, keys and values
    are views of one [T, H, nope+rope+v] tensor, instead of a concatenation of k_nope with the broadcast k_pe
    after the GEMM (at 8k tokens a 100 MB copy that ran at ~1 TB/s: 0.17 ms a layer) for 1.4x the kv_b GEMM's
    ~0.1 ms."""
    r = kv_b_weight.shape[1]
    per_head = kv_b_weight.view(num_heads, nope + v_dim, r)
    w = kv_b_weight.new_zeros(num_heads, nope + rope + v_dim, r + rope)
    w[:, :nope, :r] = per_head[:, :nope]
    w[:, nope : nope + rope, r:] = torch.eye(rope, dtype=w.dtype, device=w.device)
    w[:, nope + rope :, :r] = per_head[:, nope:]
    return w.view(num_heads * (nope + rope + v_dim), r + rope)


class _WeightCache:
    """Derived weights by their source tensor: rebuilt when the source changes in place (its version counter),
    dropped when it is freed (a weakref callback), so models built and freed in one process leak nothing."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, int, tuple, torch.Tensor]] = {}

    def get(self, source: torch.Tensor, key: tuple, build) -> torch.Tensor:
        hit = self._by_id.get(id(source))
        if hit is not None and hit[0]() is source and hit[1] == source._version and hit[2] == key:
            return hit[3]
        ident = id(source)
        ref = weakref.ref(source, lambda _, i=ident: self._by_id.pop(i, None))
        derived = build()
        self._by_id[ident] = (ref, source._version, key, derived)
        return derived

    def __len__(self) -> int:
        return len(self._by_id)


KEYS_VALUES_WEIGHTS = _WeightCache()


def keys_values_weight(
    kv_b_weight: torch.Tensor, num_heads: int, rope: int, nope: int, v_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """``build_keys_values_weight`` in ``dtype``, once per kv_b weight (``KEYS_VALUES_WEIGHTS``). The model's
    ``pack_weights`` calls it before the cache is sized from free memory, so the stacked weight is counted."""
    return KEYS_VALUES_WEIGHTS.get(
        kv_b_weight,
        (num_heads, rope, nope, v_dim, dtype),
        lambda: build_keys_values_weight(kv_b_weight, num_heads, rope, nope, v_dim).to(dtype),
    )


def mla_keys_values(
    latent: torch.Tensor, kv_b_weight: torch.Tensor, num_heads: int, kv_lora_rank: int, nope: int, v_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent rows [T, R+rope] -> (keys [T, H, nope+rope], values [T, H, v]): views of one GEMM's output."""
    rope = latent.shape[1] - kv_lora_rank
    w = keys_values_weight(kv_b_weight, num_heads, rope, nope, v_dim, latent.dtype)
    kv = F.linear(latent, w).view(latent.shape[0], num_heads, nope + rope + v_dim)
    return kv[..., : nope + rope], kv[..., nope + rope :]


__all__ = [
    "KEYS_VALUES_WEIGHTS",
    "MLA_PREFILL_SDPA",
    "build_keys_values_weight",
    "causal_self_attention",
    "cudnn_self_attention_usable",
    "keys_values_weight",
    "mla_keys_values",
]
