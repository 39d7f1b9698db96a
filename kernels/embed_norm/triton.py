"""The embedding's row gather and the first layer's input RMSNorm, one program a token.

A decode step began with two launches before its first projection: torch's gather of the embedding rows
(``weight[ids]``, an indexing kernel: ~5.6 us at batch 1 on the H100) and fla's norm of them (~2.6 us, one program).
Both are latency: one program a token now loads its id, its row, writes the row (the residual the first layer
carries) and the norm. Numerics are fla's ``layer_norm_fwd`` (contract ``naive_embed_rms_norm``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_utils import check_device, next_pow2


@triton.jit
def _embed_rms_norm_kernel(IDS, W, NW, OUT, ROWS, V, N, stride_w, eps, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    tok = tl.load(IDS + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    m = cols < N
    # an id outside [0, V) reads row 0 and stores zeros, not another tensor's memory; the engine refuses such ids
    # when a request is added (tests/test_bad_input.py)
    ok = (tok >= 0) & (tok < V)
    x = tl.load(W + tl.where(ok, tok, 0) * stride_w + cols, mask=m, other=0.0)
    x = tl.where(ok, x, tl.zeros_like(x))
    out = t.to(tl.int64) * N + cols
    tl.store(ROWS + out, x, mask=m)
    xf = x.to(tl.float32)
    rstd = 1 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)  # xf is 0 past N
    nw = tl.load(NW + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + out, (xf * rstd * nw).to(OUT.dtype.element_ty), mask=m)


def embed_rms_norm(
    weight: torch.Tensor, ids: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(weight[ids]) * norm_weight, weight[ids])`` in one launch: weight [V, H] with unit column stride,
    ids [T] integer, norm_weight [H]; both outputs [T, H] in the weight's dtype."""
    if weight.ndim != 2 or weight.stride(1) != 1:
        raise ValueError(f"embed_rms_norm: weight must be [V, H] with a unit column stride, got {tuple(weight.shape)}")
    if ids.ndim != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"embed_rms_norm: ids must be a 1-D int32 / int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
    v, n = weight.shape
    if norm_weight.shape != (n,):
        raise ValueError(f"embed_rms_norm: norm_weight must be [{n}], got {tuple(norm_weight.shape)}")
    check_device("embed_rms_norm", weight, ids, norm_weight)
    t = ids.shape[0]
    out = torch.empty(t, n, dtype=weight.dtype, device=weight.device)
    rows = torch.empty_like(out)
    if t:
        block = next_pow2(n)
        _embed_rms_norm_kernel[(t,)](
            ids, weight, norm_weight.contiguous(), out, rows, v, n, weight.stride(0), float(eps),
            BLOCK_H=block, num_warps=8 if block >= 2048 else 4,
        )  # fmt: skip
    return out, rows


__all__ = ["embed_rms_norm"]
