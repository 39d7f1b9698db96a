"""Argmax of every logits row in two launches. Contract: kernels/sampling/naive.py.

torch's argmax over a [S, 163840] row runs one reduction per row (8.7 us at S = 1, 11.4 us at S = 16 on the
H200: one SM's share of the bandwidth). Here the row is split into chunks of ``BLOCK`` columns, one program a
chunk, each writing its chunk's maximum and the first column holding it; a second launch takes, per row, the
largest of those and, among equal ones, the lowest column (the chunks are in column order), so ties resolve to
the first of equal maxima as torch's do. The second launch writes int64 ids straight into ``out`` (the decode
graph's static buffer of sampled ids).

One launch (``ticket`` given, at most ``ONE_LAUNCH_MAX_ROWS`` rows; the greedy backend's
``TANDEM_ARGMAX_ONE_LAUNCH=1``): every chunk program takes a ticket after its stores (a barrier, then a GPU-scope
acq_rel atomic) and the last one runs the second launch's reduction for every row, in blocks of 16 rows, then puts
the ticket back to 0 (the pattern of kernels/gemv/norm_after.py). The same maxima and columns, so the same ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_kwargs
from kernels.triton_utils import check_device, next_pow2

BLOCK = 2048
ONE_LAUNCH_MAX_ROWS = 64
"""The one-launch form's bound: its last program reduces every row alone (16 a block), so long batches keep two."""
_ROWS = 16


@triton.jit
def _chunk_max(X, VALS, IDX, V, stride_x, n_chunks, BLOCK: tl.constexpr):
    """This program's chunk: its maximum and the first column holding it, at [row, chunk] of VALS / IDX."""
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
def _rows_argmax(VALS, IDX, OUT, row0, S, n_chunks, ROWS: tl.constexpr, CHUNKS: tl.constexpr, CACHE: tl.constexpr):
    """Rows [row0, row0 + ROWS) below S: the largest chunk maximum and, among equal ones, the lowest column."""
    r = row0 + tl.arange(0, ROWS).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    ok = (r < S)[:, None] & (c < n_chunks)[None, :]
    at = r[:, None] * n_chunks + c[None, :]
    v = tl.load(VALS + at, mask=ok, other=float("-inf"), cache_modifier=CACHE)
    i = tl.load(IDX + at, mask=ok, other=2147483647, cache_modifier=CACHE)
    m = tl.max(v, axis=1)
    ids = tl.min(tl.where(ok & (v == m[:, None]), i, 2147483647), axis=1)
    tl.store(OUT + r, ids.to(tl.int64), mask=r < S)


@triton.jit
def _chunk_max_kernel(X, VALS, IDX, V, stride_x, n_chunks, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    _chunk_max(X, VALS, IDX, V, stride_x, n_chunks, BLOCK)


@triton.jit
def _row_argmax_kernel(VALS, IDX, OUT, S, n_chunks, CHUNKS: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    _rows_argmax(VALS, IDX, OUT, tl.program_id(0).to(tl.int64), S, n_chunks, 1, CHUNKS, "")


@triton.jit
def _argmax_one_launch_kernel(
    X, VALS, IDX, OUT, TICKET, V, stride_x, S, n_chunks,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, CHUNKS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_PDL)
    _chunk_max(X, VALS, IDX, V, stride_x, n_chunks, BLOCK)
    # every thread's stores come before the ticket's release (the one-thread atomic after the barrier)
    tl.debug_barrier()
    ticket = tl.atomic_add(TICKET, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:  # every chunk of every row is stored
        tl.debug_barrier()
        for row0 in range(0, S, ROWS):  # past L1: other SMs wrote the chunks
            _rows_argmax(VALS, IDX, OUT, row0, S, n_chunks, ROWS, CHUNKS, ".cg")
        tl.atomic_xchg(TICKET, 0, sem="relaxed", scope="gpu")  # no program of this launch touches it again


def argmax_rows(
    logits: torch.Tensor, out: torch.Tensor | None = None, ticket: torch.Tensor | None = None
) -> torch.Tensor:
    """[S, V] logits (rows contiguous) -> [S] int64 ids, into ``out`` when given (e.g. a static buffer's view).
    Graph-safe: two launches, scratch from the caching allocator, no host sync. ticket: an int32 [1] at 0
    (``kernels.triton_utils.LaunchTicket``), left at 0: one launch for up to ``ONE_LAUNCH_MAX_ROWS`` rows."""
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
    if ticket is not None and s <= ONE_LAUNCH_MAX_ROWS:
        check_device("argmax_rows", ticket)
        if ticket.shape != (1,) or ticket.dtype != torch.int32:
            raise ValueError(f"ticket must be an int32 [1], got {ticket.dtype} {tuple(ticket.shape)}")
        _argmax_one_launch_kernel[(s, n_chunks)](
            logits, vals, idx, out, ticket, v, logits.stride(0), s, n_chunks, BLOCK=BLOCK, ROWS=_ROWS,
            CHUNKS=next_pow2(n_chunks), num_warps=4, **pdl_kwargs(logits, "sampling.chunk_max"),
        )  # fmt: skip
        return out
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
    chunks = next_pow2(n_chunks)
    _row_argmax_kernel[(s,)](
        vals, idx, out, s, n_chunks, CHUNKS=chunks, num_warps=1, **pdl_kwargs(logits, "sampling.row_argmax")
    )
    return out
