"""Prefetch weights into L2 while latency-bound launches run, so the GEMV after them reads L2, not HBM.

A batch-1 decode step alternates bandwidth-bound launches (the projections' and experts' weight streams) with
latency-bound ones (the short conv, the KDA recurrence, the attention's split and combine, the norms, the routing)
that leave HBM idle for 8-30 us at a time. Hopper's bulk prefetch (``cp.async.bulk.prefetch.L2.global``, PTX 8.0,
sm_90) asks the TMA unit to pull a byte range into L2: a launch of one warp a program issues one instruction a
lane. Its programs retire only once the copy unit has taken their requests (4-4.5 us for 19 MB on the H100,
``bench/l2_prefetch.py``), so the engine launches it on a side stream (engine/backends/prefetch.py) where that
overlaps the window's launches. The GEMV that follows the window then finds its weight in L2 (50 MB on the
H100 / H200). A prefetch is a hint: it changes no memory a kernel
reads, so every output is the same with and without it; a range that is evicted before use costs only its bytes.

Contract: every byte of each range is covered exactly once by 16-byte-aligned pieces of at most ``chunk`` bytes
(``RECORD``: the pieces are written out instead of prefetched, which the host tests check under the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_utils import is_interpreting

CHUNK_BYTES = 4096
"""Bytes a lane asks for in one instruction."""
LANES = 32
"""Lanes of a program (one warp): a program covers ``CHUNK_BYTES * LANES`` = 128 KB, so a 19 MB weight spreads its
requests over ~150 programs, i.e. over every SM's copy unit rather than one."""
MAX_RANGES = 2


@triton.jit
def bulk_prefetch_l2(addr, size):
    """One instruction a lane: pull ``size`` bytes (a multiple of 16; <= 0 asks nothing) from ``addr`` (16-byte
    aligned) into L2. ``is_pure=False``: its result is read by no one, and it must not be removed as dead code."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r",
        [addr, size.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _l2_prefetch_kernel(
    BASE_A,  # *u8
    NBYTES_A,  # i64, a multiple of 16
    PROGS_A,  # programs that cover range A; the rest cover range B
    BASE_B,
    NBYTES_B,
    RECORD,  # *i64 [programs * LANES, 2] (offset, size) when RECORD_PIECES; else unused
    CHUNK: tl.constexpr,
    LANES: tl.constexpr,
    RECORD_PIECES: tl.constexpr,
):
    pid = tl.program_id(0)
    lane = tl.arange(0, LANES).to(tl.int64)
    in_a = pid < PROGS_A
    base = tl.where(in_a, BASE_A, BASE_B)
    nbytes = tl.where(in_a, NBYTES_A, NBYTES_B)
    local = tl.where(in_a, pid, pid - PROGS_A).to(tl.int64)
    offs = (local * LANES + lane) * CHUNK
    size = tl.minimum(nbytes - offs, CHUNK)  # <= 0 past the range's end: nothing asked
    if RECORD_PIECES:
        row = (pid.to(tl.int64) * LANES + lane) * 2
        tl.store(RECORD + row, tl.where(size > 0, offs + tl.where(in_a, 0, 1 << 40), -1))
        tl.store(RECORD + row + 1, tl.maximum(size, 0))
    else:
        bulk_prefetch_l2(base + offs, size)


@triton.jit
def span_pieces(nbytes, LANES: tl.constexpr):
    """Lane i's piece of the byte range [0, ``nbytes``) (a multiple of 16): (offset, size) in equal 16-byte-multiple
    chunks; a lane past the end gets size <= 0 (asks nothing)."""
    lane = tl.arange(0, LANES).to(tl.int64)
    chunk = (nbytes + LANES * 16 - 1) // (LANES * 16) * 16
    offs = lane * chunk
    return offs, tl.minimum(nbytes - offs, chunk)


@triton.jit
def _span_pieces_kernel(OUT, nbytes, LANES: tl.constexpr):
    offs, size = span_pieces(nbytes, LANES)
    lane = tl.arange(0, LANES)
    tl.store(OUT + lane * 2, offs)
    tl.store(OUT + lane * 2 + 1, size)


def record_span_pieces(nbytes: int, lanes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``span_pieces``' (offset, size) of each of ``lanes`` lanes for a range of ``nbytes``, as [lanes, 2] int64:
    what ``prefetch_span_to_l2`` asks for, written out instead (runs under the interpreter; for tests)."""
    if nbytes % 16 or nbytes <= 0 or lanes <= 0 or lanes & (lanes - 1):
        raise ValueError(f"nbytes: a positive multiple of 16, lanes: a power of two; got {nbytes}, {lanes}")
    out = torch.full((lanes, 2), -7, dtype=torch.int64, device=device)
    _span_pieces_kernel[(1,)](out, nbytes, LANES=lanes)
    return out


@triton.jit
def prefetch_span_to_l2(base, nbytes, LANES: tl.constexpr):
    """From inside another kernel: ask for ``nbytes`` (a multiple of 16) from ``base`` (a 16-byte-aligned ``*u8``)
    to be pulled into L2, one bulk-prefetch instruction a lane. ``LANES`` = 32 x the kernel's warps, so each lane
    holds one piece and no piece is asked twice. A hint: no memory changes. sm_90+ only (no interpreter form)."""
    offs, size = span_pieces(nbytes, LANES)
    bulk_prefetch_l2(base + offs, size)


def _byte_range(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    if not t.is_contiguous():
        raise ValueError(f"l2_prefetch: a range must be one contiguous tensor, got strides {tuple(t.stride())}")
    if t.data_ptr() % 16:
        raise ValueError(f"l2_prefetch: a range must start 16-byte aligned, got address {t.data_ptr():#x}")
    return t.view(-1).view(torch.uint8), t.numel() * t.element_size() // 16 * 16  # a tail under 16 B is not asked


def l2_prefetch(*tensors: torch.Tensor, record: bool = False) -> torch.Tensor | None:
    """Ask for up to ``MAX_RANGES`` contiguous tensors to be pulled into L2, in one launch. ``record``: write the
    pieces instead (``[pieces, 2]`` int64 (offset, size), offset + 2**40 for the second range), for tests."""
    if not 1 <= len(tensors) <= MAX_RANGES:
        raise ValueError(f"l2_prefetch takes 1..{MAX_RANGES} tensors, got {len(tensors)}")
    if not record and (is_interpreting() or not tensors[0].is_cuda):
        raise ValueError("l2_prefetch: the prefetch instruction needs a CUDA device (record=True runs anywhere)")
    ranges = [_byte_range(t) for t in tensors]
    per_prog = CHUNK_BYTES * LANES
    progs = [triton.cdiv(n, per_prog) for _, n in ranges]
    (a, na), (b, nb) = ranges[0], ranges[-1] if len(ranges) > 1 else (ranges[0][0], 0)
    grid = progs[0] + (progs[1] if len(ranges) > 1 else 0)
    if grid == 0:
        return torch.empty(0, 2, dtype=torch.int64) if record else None
    out = torch.full((grid * LANES, 2), -2, dtype=torch.int64, device=a.device) if record else a
    _l2_prefetch_kernel[(grid,)](
        a, na, progs[0], b, nb, out, CHUNK=CHUNK_BYTES, LANES=LANES, RECORD_PIECES=record, num_warps=1
    )
    return out if record else None


__all__ = [
    "CHUNK_BYTES",
    "LANES",
    "MAX_RANGES",
    "bulk_prefetch_l2",
    "l2_prefetch",
    "prefetch_span_to_l2",
    "record_span_pieces",
    "span_pieces",
]
