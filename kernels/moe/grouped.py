"""MoE experts as grouped GEMMs over tokens sorted by expert (torch; no Triton). Contract: naive.naive_moe.

    sort the T*k (token, expert) pairs by expert -> offsets per expert
    h1 = x_sorted @ w1[e]^T, h3 = x_sorted @ w3[e]^T   (grouped GEMM, one launch for all experts)
    a  = silu(h1) * h3
    y  = a @ w2[e]^T                                    (grouped GEMM)
    out[t] = sum_s weight[t, s] * y[row of pair (t, s)] (the combine: gathers, fp32 sum, no atomics;
                                                         one Triton launch in kernels/moe/combine.py)

``impl="grouped_mm"`` uses ``torch.nn.functional.grouped_mm`` (CUTLASS on sm90: bf16 only, 16-byte aligned
rows); ``impl="loop"`` runs one matmul per non-empty expert on the same sorted layout (one host sync);
``impl="auto"`` takes grouped_mm for bf16 CUDA tensors on sm80+ and the loop otherwise (and for good, with a
warning, if grouped_mm ever refuses the inputs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.activation import silu_mul

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
logger = logging.getLogger(__name__)


@dataclass
class MoEAlign:
    """Sorted layout of the (token, slot) pairs: pair ``order[j]`` (flat index t*k + s) is row j."""

    order: torch.Tensor  # [T*k] int64
    token: torch.Tensor  # [T*k] int64 token of each sorted row
    offsets: torch.Tensor  # [E] int32 end row of each expert's group (cumulative counts)
    position: torch.Tensor | None = None  # [T*k] int64 row of each pair (the inverse of order), if known

    def rows_of_pairs(self) -> torch.Tensor:
        """[T*k] sorted row of each (token, slot) pair."""
        if self.position is not None:
            return self.position
        pos = torch.empty_like(self.order)
        return pos.scatter_(0, self.order, torch.arange(self.order.numel(), device=self.order.device))


def moe_combine(
    y: torch.Tensor,
    rows: torch.Tensor | None,
    weights: torch.Tensor,
    out_dtype: torch.dtype,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_s weights[t, s] * y[rows[t * k + s]] in fp32. y [T*k, H] expert outputs in sorted order,
    rows [T*k] (None: y is in pair order), weights [T, k] -> [T, H] ``out_dtype``, then ``+ add`` [T, H] when
    given (the shared expert). (kernels/moe/combine.py: the same in one launch.)"""
    t, k = weights.shape
    picked = (y if rows is None else y[rows]).view(t, k, y.shape[1]).float()
    out = (picked * weights.float()[..., None]).sum(dim=1).to(out_dtype)
    return out if add is None else out + add


def moe_align(ids: torch.Tensor, num_experts: int) -> MoEAlign:
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True)[1]
    # scatter_add, not bincount: bincount reads the max id on the host (a sync a CUDA graph cannot hold)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    return MoEAlign(order=order, token=order // ids.shape[1], offsets=counts.cumsum(0).to(torch.int32))


_GROUPED_MM_FAILED = False


def _grouped_mm_failed(err: Exception) -> None:
    global _GROUPED_MM_FAILED
    _GROUPED_MM_FAILED = True
    logger.warning("torch grouped_mm failed (%s); MoE experts fall back to the per-expert loop", err)


def grouped_mm_supported(x: torch.Tensor) -> bool:
    if _grouped_mm is None or x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 0)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """a [R, in] sorted rows; w [E, out, in]; offsets [E] int32 group ends -> a @ w[e]^T per group (torch's
    grouped_mm: bf16 on CUDA sm80+, ``grouped_mm_supported``)."""
    # w.transpose is the column-major [E, in, out]
    return _grouped_mm(a, w.transpose(1, 2), offs=offsets)


def _gemm_loop(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    out = a.new_empty(a.shape[0], w.shape[1])
    ends = offsets.tolist()
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            out[start:end] = F.linear(a[start:end], w[e])
        start = end
    return out


def grouped_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    impl: str = "auto",
    w13: torch.Tensor | None = None,
    align: Callable[[torch.Tensor, int], MoEAlign] | None = None,
    combine: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [T, H]; weights [T, k] fp32; ids [T, k]; w1/w3 (gate/up) [E, I, H]; w2 (down) [E, H, I] -> [T, H].
    w13 [E, 2I, H]: w1 | w3 stacked (optional): the gate and up projections as one grouped GEMM.
    align: builds the expert-sorted layout (default ``moe_align``; kernels/moe/align.py has a one-launch one).
    combine: the weighted sum of each token's k expert outputs (default ``moe_combine``; kernels/moe/combine.py).
    The routing weight is applied to the down projection's output, in fp32 (as HF's reference does)."""
    if x.ndim != 2 or ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"x [T, H], weights and ids [T, k]; got {tuple(x.shape)}, {tuple(weights.shape)}, {tuple(ids.shape)}"
        )
    e, i, h = w1.shape
    if w3.shape != (e, i, h) or w2.shape != (e, h, i) or x.shape[1] != h:
        raise ValueError(f"w1/w3 must be [E, I, H] and w2 [E, H, I] with H={x.shape[1]}")
    auto = impl == "auto"
    if auto:
        impl = "grouped_mm" if grouped_mm_supported(x) and not _GROUPED_MM_FAILED else "loop"
    if impl not in ("grouped_mm", "loop"):
        raise ValueError(f"impl must be auto, grouped_mm or loop, got {impl!r}")
    if impl == "grouped_mm" and _grouped_mm is None:
        raise RuntimeError("this torch has no grouped_mm")
    gemm = grouped_gemm if impl == "grouped_mm" else _gemm_loop
    t = ids.shape[0]
    if t == 0:
        return torch.zeros_like(x)
    al = (align or moe_align)(ids, e)
    xs = x[al.token]  # [T*k, H]
    if w13 is not None and w13.shape != (e, 2 * i, h):
        raise ValueError(f"w13 must be [E, 2I, H] = {(e, 2 * i, h)}, got {tuple(w13.shape)}")

    def gate_up(gemm: Callable) -> torch.Tensor:  # [T*k, I]
        if w13 is None:
            return silu_mul(gemm(xs, w1, al.offsets), gemm(xs, w3, al.offsets))
        h13 = gemm(xs, w13, al.offsets)
        return silu_mul(h13[:, :i], h13[:, i:])

    try:
        a = gate_up(gemm)
    except RuntimeError as err:  # a layout/arch grouped_mm refuses: the loop is always correct
        if not (auto and impl == "grouped_mm"):
            raise
        _grouped_mm_failed(err)
        gemm = _gemm_loop
        a = gate_up(gemm)
    y = gemm(a, w2, al.offsets)  # [T*k, H]
    return (combine or moe_combine)(y, al.rows_of_pairs(), weights, x.dtype)


__all__ = ["MoEAlign", "grouped_gemm", "grouped_mm_supported", "grouped_moe", "moe_align", "moe_combine"]
