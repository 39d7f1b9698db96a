"""The expert-sorted layout of a step's (token, expert) pairs in one Triton launch. Contract: ``grouped.moe_align``.

``moe_align`` (torch) takes a stable radix sort, a scatter-add of counts, a cumsum and an integer divide: about
nine kernels per MoE layer. At decode sizes (a few thousand pairs) one launch does it all, one program per
expert: its group starts after every pair of a lower expert (a count over all pairs), and its pairs take the
next rows in pair order (an exclusive cumsum of "this pair is mine"). That is exactly the stable sort's order.
Each program reads the N ids twice (N * 8 bytes: 4 KB at a 64-token decode step) and nothing is serial across
experts. (The first version walked all pairs in one program, counts then placement: 27.9 us at 512 pairs on
an H200, 2.4 us at 8; it is in git history.)

Prefill steps (65,536 pairs at 8k tokens, top-8) took torch's path: a radix sort and a scatter-add, a cumsum,
a scatter and an integer divide, ~9 kernels and ~100 us a MoE layer on an H200. ``moe_align_blocks`` is a
counting sort in three launches over blocks of pairs: each block's per-expert histogram; one program turns
the [blocks, E] counts into each (block, expert)'s first row (experts in order, blocks in order inside an
expert); each block sorts its (expert, pair) keys and writes every pair at its row. Same stable order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.env import env_switch
from kernels.moe.grouped import MoEAlign, moe_align
from kernels.pdl import pdl_enter, pdl_kwargs
from kernels.triton_utils import check_device, is_interpreting, next_pow2

BLOCK_ALIGN = env_switch("TANDEM_MOE_BLOCK_ALIGN", True)
"""``moe_align_blocks`` for long steps (read once: ``moe_align_auto`` runs in every MoE layer of every step)."""

MAX_PAIRS = 8192
"""Above this many (token, expert) pairs, torch's sort (set for the first, one-program kernel; each program of
this one reads all N ids, so long steps stay with the sort)."""


@triton.jit
def _moe_align_by_expert_kernel(
    IDS,  # [N] int64 expert of each pair (pair j = token j // TOP_K, slot j % TOP_K)
    ORDER,  # [N] int64 out: pair index of each sorted row
    TOKEN,  # [N] int64 out: token of each sorted row
    POSITION,  # [N] int64 out: sorted row of each pair (the inverse of ORDER)
    ENDS,  # [E] int32 out: end row of each expert's group
    N,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    e = tl.program_id(0)
    o_b = tl.arange(0, BLOCK)
    lower = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, N, BLOCK):
        o = start + o_b
        b_id = tl.load(IDS + o, mask=o < N, other=0x7FFFFFFF).to(tl.int32)
        lower += (b_id < e).to(tl.int32)
    row = tl.sum(lower, axis=0)  # this expert's first row, then the next free one
    for start in range(0, N, BLOCK):
        o = start + o_b
        m = o < N
        b_id = tl.load(IDS + o, mask=m, other=0x7FFFFFFF).to(tl.int32)
        mine = ((b_id == e) & m).to(tl.int32)
        pos = row + tl.cumsum(mine, axis=0) - mine  # earlier pairs of this expert come first: stable
        hit = mine != 0
        tl.store(ORDER + pos, o.to(tl.int64), mask=hit)
        tl.store(TOKEN + pos, (o // TOP_K).to(tl.int64), mask=hit)
        tl.store(POSITION + o, pos.to(tl.int64), mask=hit)
        row += tl.sum(mine, axis=0)
    tl.store(ENDS + e, row)


def moe_align_triton(ids: torch.Tensor, num_experts: int, block: int | None = None, num_warps: int = 4) -> MoEAlign:
    """ids [T, k] int64 -> the layout ``moe_align`` returns (the same stable order), in one launch of one
    program per expert. ``block``: ids per load (default: all of them, up to 1,024)."""
    check_device("moe_align_triton", ids)
    if ids.ndim != 2:
        raise ValueError(f"ids must be [T, k], got {tuple(ids.shape)}")
    flat = ids.reshape(-1).contiguous()
    n = flat.numel()
    order = torch.empty(n, dtype=torch.int64, device=ids.device)
    token = torch.empty(n, dtype=torch.int64, device=ids.device)
    position = torch.empty(n, dtype=torch.int64, device=ids.device)
    if n == 0:
        empty = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
        return MoEAlign(order=order, token=token, offsets=empty, position=position)
    ends = torch.empty(num_experts, dtype=torch.int32, device=ids.device)  # every program writes its end
    blk = block or min(1024, max(16, next_pow2(n)))
    _moe_align_by_expert_kernel[(num_experts,)](
        flat,
        order,
        token,
        position,
        ends,
        n,
        TOP_K=ids.shape[1],
        BLOCK=blk,
        num_warps=num_warps,
        **pdl_kwargs(flat, "moe.align"),
    )
    return MoEAlign(order=order, token=token, offsets=ends, position=position)


@triton.jit
def _block_counts_kernel(IDS, COUNTS, N, E: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """COUNTS[b, e]: pairs of block b routed to expert e."""
    pdl_enter(USE_PDL)
    b = tl.program_id(0)
    o = b * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(IDS + o, mask=o < N, other=0).to(tl.int32)
    o_e = tl.arange(0, E)
    pad = BLOCK - tl.minimum(N - b * BLOCK, BLOCK)  # ids past the end were counted in bin 0
    hist = tl.histogram(ids, E) - tl.where(o_e == 0, pad, 0)
    tl.store(COUNTS + b * E + o_e, hist)


@triton.jit
def _block_rows_kernel(COUNTS, SHIFT, ENDS, NB, E: tl.constexpr, USE_PDL: tl.constexpr):
    """SHIFT[b, e] = first row of block b's pairs of expert e minus the pairs of lower experts in block b
    (so a block's i-th pair in (expert, pair) order lands at SHIFT[b, e] + i); ENDS[e] = expert e's end row."""
    pdl_enter(USE_PDL)
    o_e = tl.arange(0, E)
    total = tl.zeros([E], dtype=tl.int32)
    for b in range(NB):
        total += tl.load(COUNTS + b * E + o_e)
    run = tl.cumsum(total, 0) - total  # expert e's first row
    tl.store(ENDS + o_e, run + total)
    for b in range(NB):
        c = tl.load(COUNTS + b * E + o_e)
        tl.store(SHIFT + b * E + o_e, run - (tl.cumsum(c, 0) - c))
        run += c


@triton.jit
def _block_place_kernel(
    IDS,
    SHIFT,
    ORDER,
    TOKEN,
    POSITION,
    N,
    E: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    b = tl.program_id(0)
    o_b = tl.arange(0, BLOCK)
    o = b * BLOCK + o_b
    ids = tl.load(IDS + o, mask=o < N, other=E).to(tl.int32)
    keys = tl.sort(ids * BLOCK + o_b)  # (expert, pair) order: stable inside an expert
    e = keys // BLOCK
    pair = b * BLOCK + keys % BLOCK
    live = e < E
    pos = tl.load(SHIFT + b * E + e, mask=live, other=0) + o_b
    tl.store(ORDER + pos, pair.to(tl.int64), mask=live)
    tl.store(TOKEN + pos, (pair // TOP_K).to(tl.int64), mask=live)
    tl.store(POSITION + pair, pos.to(tl.int64), mask=live)


def moe_align_blocks(ids: torch.Tensor, num_experts: int, block: int = 2048, num_warps: int = 4) -> MoEAlign:
    """ids [T, k] int64 -> ``moe_align``'s layout (the same stable order) by a counting sort in three launches
    over blocks of ``block`` pairs (a power of two): for steps of any size, no host sync."""
    check_device("moe_align_blocks", ids)
    if ids.ndim != 2:
        raise ValueError(f"ids must be [T, k], got {tuple(ids.shape)}")
    if block != next_pow2(block) or num_experts != next_pow2(num_experts):
        raise ValueError(f"block ({block}) and num_experts ({num_experts}) must be powers of two")
    flat = ids.reshape(-1).contiguous()
    n, dev = flat.numel(), ids.device
    order, token, position = (torch.empty(n, dtype=torch.int64, device=dev) for _ in range(3))
    ends = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    if n == 0:
        return MoEAlign(order=order, token=token, offsets=ends, position=position)
    nb = triton.cdiv(n, block)
    counts = torch.empty(nb, num_experts, dtype=torch.int32, device=dev)
    shift = torch.empty_like(counts)
    meta = dict(E=num_experts, BLOCK=block, num_warps=num_warps)
    _block_counts_kernel[(nb,)](flat, counts, n, **meta, **pdl_kwargs(flat, "moe.block_counts"))
    _block_rows_kernel[(1,)](
        counts, shift, ends, nb, E=num_experts, num_warps=num_warps, **pdl_kwargs(flat, "moe.block_rows")
    )
    _block_place_kernel[(nb,)](
        flat, shift, order, token, position, n, TOP_K=ids.shape[1], **meta, **pdl_kwargs(flat, "moe.block_place")
    )
    return MoEAlign(order=order, token=token, offsets=ends, position=position)


def moe_align_auto(ids: torch.Tensor, num_experts: int) -> MoEAlign:
    """The one-launch kernel for a decode-sized step on CUDA (or under the interpreter: the GPU backends'
    tests on the host), the block counting sort for longer steps, torch's sort off CUDA (or with
    ``TANDEM_MOE_BLOCK_ALIGN=0``, or expert counts that are not a power of two)."""
    if not (ids.is_cuda or is_interpreting()) or ids.numel() == 0:
        return moe_align(ids, num_experts)
    if ids.numel() <= MAX_PAIRS:
        return moe_align_triton(ids, num_experts)
    if BLOCK_ALIGN and num_experts == next_pow2(num_experts):
        return moe_align_blocks(ids, num_experts)
    return moe_align(ids, num_experts)


__all__ = ["BLOCK_ALIGN", "MAX_PAIRS", "moe_align_auto", "moe_align_blocks", "moe_align_triton"]
