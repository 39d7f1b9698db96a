"""Argmax of every logits row in two launches. Contract: kernels/sampling/naive.py.

torch's argmax over a [S, 163840] row runs one reduction per row (8.7 us at S = 1, 11.4 us at S = 16 on the
H200: one SM's share of the bandwidth). Here the row is split into chunks of ``BLOCK`` columns, one program a
chunk, each writing its chunk's maximum and the first column holding it; a second launch takes, per row, the
largest of those and, among equal ones, the lowest column (the chunks are in column order), so ties resolve to
the first of equal maxima as torch's do. The second launch writes int64 ids straight into ``out`` (the decode
graph's static buffer of sampled ids).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_kwargs
from kernels.triton_utils import check_device, next_pow2

BLOCK = 2048


@triton.jit
def _chunk_max_kernel(X, VALS, IDX, V, stride_x, n_chunks, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    # the first column of the chunk equal to its maximum; a chunk of -inf only reports its first column
    first = tl.min(tl.where(x == m, cols, 2147483647), axis=0)
    tl.store(VALS + row * n_chunks + chunk, m)
    tl.store(IDX + row * n_chunks + chunk, first)


@triton.jit
def _row_argmax_kernel(VALS, IDX, OUT, n_chunks, CHUNKS: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    ok = c < n_chunks
    v = tl.load(VALS + row * n_chunks + c, mask=ok, other=float("-inf"))
    i = tl.load(IDX + row * n_chunks + c, mask=ok, other=2147483647)
    m = tl.max(v, axis=0)
    tl.store(OUT + row, tl.min(tl.where(ok & (v == m), i, 2147483647), axis=0).to(tl.int64))


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[S, V] logits (rows contiguous) -> [S] int64 ids, into ``out`` when given (e.g. a static buffer's view).
    Graph-safe: two launches, scratch from the caching allocator, no host sync."""
    if logits.ndim != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [S, V] with contiguous rows, got shape {tuple(logits.shape)}")
    s, v = logits.shape
    if out is None:
        out = torch.empty(s, dtype=torch.int64, device=logits.device)
    if out.shape != (s,) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int64 [{s}], got {out.dtype} {tuple(out.shape)}")
    check_device("argmax_rows", logits, out)
    if s == 0:
        return out
    if v == 0:
        raise ValueError("argmax_rows: logits rows are empty (V = 0)")
    n_chunks = triton.cdiv(v, BLOCK)
    vals = torch.empty(s, n_chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(s, n_chunks, dtype=torch.int32, device=logits.device)
    _chunk_max_kernel[(s, n_chunks)](
        logits,
        vals,
        idx,
        v,
        logits.stride(0),
        n_chunks,
        BLOCK=BLOCK,
        num_warps=4,
        **pdl_kwargs(logits, "sampling.chunk_max"),
    )
    _row_argmax_kernel[(s,)](
        vals, idx, out, n_chunks, CHUNKS=next_pow2(n_chunks), num_warps=1, **pdl_kwargs(logits, "sampling.row_argmax")
    )
    return out
