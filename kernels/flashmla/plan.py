"""Tandem's split plan for FlashMLA's dense decode, written on the device by one small Triton program.

Why not FlashMLA's own planner: it is a one-warp kernel whose serial loop over the 132 parts took ~26 us on the
H200 (as long as the attention kernel at batch 1-16), and at batch 1 it cuts a 4k context into 64 one-page
splits, so the combine then costs ~18 us a layer. Here every part's row is closed-form from the prefix sum of the
requests' block counts, so one program computes all of them at once (vectorised over parts, chunked over
requests), and the policy picks how many parts to use: fewer than the grid's at small batches, the rest empty.

Policy "even blocks" (the contract: ``naive_plan`` in kernels/flashmla/naive_plan.py, which also describes the
plan's format): the requests' blocks laid end to end, part i takes blocks [i q, (i+1) q) with
q = ceil(total / num_parts). Graph-safe: the lengths are read on the device only; b, num_parts and grid_parts are
host ints fixed per captured batch size.

``TANDEM_FLASHMLA_PARTS``: ``auto`` (default: every part of the grid, each taking at least ``AUTO_MIN_BLOCKS``
blocks, so the part count follows the step's lengths on the device; at most ``AUTO_MAX_PARTS_PER_SEQ`` parts a
sequence, ``TANDEM_FLASHMLA_MAX_PARTS_PER_SEQ``), an int (at most that many parts), or
``flashmla`` (FlashMLA plans itself, as before: for A / B runs). ``TANDEM_FLASHMLA_MIN_BLOCKS`` overrides the
fewest blocks a part takes.

Measured on the H200 (``python -m bench.flashmla_parts``, docs/PERFORMANCE.md, twenty-second session; one launch
of plan + split kernel + combine at Kimi-Linear's shape): at least 4 blocks a part over the whole grid took
18.6 / 34.6 / 84.5 us at batch 1 / 16 / 64 over 4k contexts against FlashMLA's own plan's 49.1 / 57.2 / 114.7, and
46.6 / 155.6 / 578.4 against 71.6 / 175.8 / 595.3 over 32k; fixed part counts lose at one end or the other (8
parts: 21.6 us at 1 x 4k but 100.5 at 1 x 32k), and 8 blocks a part is within 1 % of 4 summed over those
workloads (better at 1 x 32k, worse at 1-4 x 4k).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.flashmla.naive_plan import BLOCK, META_INTS, combine_max_splits
from kernels.pdl import pdl_kwargs, pdl_wait
from kernels.triton_utils import check_device, next_pow2

PARTS_ENV = "TANDEM_FLASHMLA_PARTS"


@functools.cache
def _positive_int_or_word(name: str, value: str, words: tuple[str, ...], what: str) -> int | str:
    """An environment setting: one of ``words`` or a positive int; anything else raises, naming the variable."""
    if value in words:
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        allowed = "".join(f"{w!r} or " for w in words)
        raise ValueError(f"{name} must be {allowed}a positive number of {what}, got {value!r}")
    return n


def parts_setting() -> int | str:
    """``TANDEM_FLASHMLA_PARTS``: 'auto', 'flashmla', or a forced part count."""
    return _positive_int_or_word(PARTS_ENV, os.environ.get(PARTS_ENV, "auto"), ("auto", "flashmla"), "parts")


def num_parts_for(batch: int, grid_parts: int) -> int | None:
    """Parts of the split kernel's ``grid_parts`` to plan a decode launch of ``batch`` sequences over (None:
    FlashMLA plans itself). Host ints only: CUDA graphs are captured per batch size."""
    setting = parts_setting()
    if setting == "flashmla":
        return None
    if isinstance(setting, int):
        if setting > grid_parts:
            raise ValueError(f"{PARTS_ENV}={setting}, but FlashMLA's grid has {grid_parts} parts here")
        return setting
    # auto: every part of the grid, each taking at least AUTO_MIN_BLOCKS blocks, at most MAX_PARTS_PER_SEQ a sequence
    return min(grid_parts, max_parts_per_seq_setting() * batch)


MIN_BLOCKS_ENV = "TANDEM_FLASHMLA_MIN_BLOCKS"
AUTO_MIN_BLOCKS = 4
"""Blocks (pages of 64 keys) a part takes at least under the auto policy: a part's fixed cost (its Q load, the
pipeline's fill, one more split for the combine) paid over at least 256 keys (bench/flashmla_parts.py)."""


MAX_PARTS_PER_SEQ_ENV = "TANDEM_FLASHMLA_MAX_PARTS_PER_SEQ"
AUTO_MAX_PARTS_PER_SEQ = 64
"""Parts the auto policy plans at most per sequence of the batch: past ~64 splits of one sequence the combine's
serial walk over them costs more than the split kernel saves (H100, ``python -m bench.flashmla_parts``, one
sequence, us a launch, 4 blocks a part vs 64 parts: 32k 49.3 -> 42.0, 64k 62.5 -> 53.8; the combine alone took
30.5 us of a 1 x 32k launch at 128 parts; docs/PERFORMANCE.md, twenty-ninth session). Only batches of one or two
sequences plan fewer than the grid's 132 parts."""


def max_parts_per_seq_setting() -> int:
    """``TANDEM_FLASHMLA_MAX_PARTS_PER_SEQ``: the most parts the auto policy gives each sequence of the batch."""
    value = os.environ.get(MAX_PARTS_PER_SEQ_ENV, str(AUTO_MAX_PARTS_PER_SEQ))
    return int(_positive_int_or_word(MAX_PARTS_PER_SEQ_ENV, value, (), "parts"))


def min_blocks_setting() -> int:
    """``TANDEM_FLASHMLA_MIN_BLOCKS``: the fewest key blocks a part of Tandem's plan takes (default
    ``AUTO_MIN_BLOCKS``)."""
    value = os.environ.get(MIN_BLOCKS_ENV, str(AUTO_MIN_BLOCKS))
    return int(_positive_int_or_word(MIN_BLOCKS_ENV, value, (), "blocks"))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def flashmla_grid_parts(device: torch.device, num_heads: int) -> int:
    """The split kernel's part count (num_sm_parts), as dense_decode.h fixes it for one query per sequence over
    one latent head: SMs / ceil(heads / 64). A plan must have exactly this many rows."""
    return max(_num_sms(device) // -(-num_heads // 64), 1)


@triton.jit
def _request_blocks(SEQLENS, r, B, PAGE: tl.constexpr):
    """Blocks of requests r (0 past B): FlashMLA counts an empty request as one."""
    m = r < B
    n = tl.load(SEQLENS + r, mask=m, other=0)
    return tl.where(m, tl.maximum((tl.maximum(n, 0) + PAGE - 1) // PAGE, 1), 0), m


@triton.jit
def _even_blocks_plan_kernel(
    SEQLENS,  # [B] int32 context lengths
    META,  # [GRID_PARTS, 8] int32 out
    NUM_SPLITS,  # [B + 1] int32 out, cumulative
    B,
    NUM_PARTS,
    GRID_PARTS,
    MIN_BLOCKS,
    PAGE: tl.constexpr,
    BLOCK_R: tl.constexpr,  # requests per chunk
    BLOCK_P: tl.constexpr,  # >= GRID_PARTS
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)  # FlashMLA's kernel follows and reads the plan without waiting: no early start
    offs_r = tl.arange(0, BLOCK_R)
    total = 0
    for r0 in range(0, B, BLOCK_R):
        n, _ = _request_blocks(SEQLENS, r0 + offs_r, B, PAGE)
        total += tl.sum(n, 0)
    q = tl.maximum((total + NUM_PARTS - 1) // NUM_PARTS, MIN_BLOCKS)  # blocks a part
    p = tl.arange(0, BLOCK_P)
    lo = p * q  # the part's global blocks [lo, hi)
    hi = tl.minimum(lo + q, total)
    # Per part: its first / last block's request (= the requests ending at or before that block) and where
    # that request starts (= the latest such end), reduced over [BLOCK_P, BLOCK_R] tiles of requests.
    begin_req = tl.zeros([BLOCK_P], tl.int32)
    end_req = tl.zeros([BLOCK_P], tl.int32)
    s_begin = tl.zeros([BLOCK_P], tl.int32)
    s_end = tl.zeros([BLOCK_P], tl.int32)
    block_carry = 0
    split_carry = 0
    for r0 in range(0, B, BLOCK_R):
        r = r0 + offs_r
        n, m = _request_blocks(SEQLENS, r, B, PAGE)
        e = tl.cumsum(n, 0) + block_carry  # each request's end (exclusive) in the global block order
        s = e - n
        k = tl.where(m, (e - 1) // q - s // q + 1, 0)  # its splits: the parts holding its first .. last block
        tl.store(NUM_SPLITS + 1 + r, tl.cumsum(k, 0) + split_carry, mask=m)
        ended_lo = m[None, :] & (e[None, :] <= lo[:, None])
        ended_hi = m[None, :] & (e[None, :] <= (hi - 1)[:, None])
        begin_req += tl.sum(ended_lo.to(tl.int32), 1)
        end_req += tl.sum(ended_hi.to(tl.int32), 1)
        s_begin = tl.maximum(s_begin, tl.max(tl.where(ended_lo, e[None, :], 0), 1))
        s_end = tl.maximum(s_end, tl.max(tl.where(ended_hi, e[None, :], 0), 1))
        block_carry += tl.sum(n, 0)
        split_carry += tl.sum(k, 0)
    tl.store(NUM_SPLITS, 0)

    in_grid = p < GRID_PARTS
    live = in_grid & (lo < total)
    end_len = tl.load(SEQLENS + end_req, mask=live, other=0)
    n_end = tl.maximum((tl.maximum(end_len, 0) + PAGE - 1) // PAGE, 1)
    # A request is split iff another part touches it: the part starts inside its first request or ends inside
    # its last; with one request both flags are the OR, as FlashMLA sets them.
    starts_mid = lo != s_begin
    ends_mid = hi != s_end + n_end
    same = begin_req == end_req
    first = (starts_mid | (same & ends_mid)).to(tl.int32)
    last = (ends_mid | (same & starts_mid)).to(tl.int32)
    end_block = tl.where(end_len > 0, hi - s_end, 0)  # an empty request ends at block 0, as in FlashMLA
    begin_split = p - s_begin // q  # parts before this one holding a block of its first request
    row = META + p * 8
    zero = tl.zeros([BLOCK_P], tl.int32)
    tl.store(row + 0, tl.where(live, begin_req, B), mask=in_grid)  # empty parts: requests B .. B-1
    tl.store(row + 1, tl.where(live, end_req, B - 1), mask=in_grid)
    tl.store(row + 2, tl.where(live, lo - s_begin, 0), mask=in_grid)
    tl.store(row + 3, tl.where(live, end_block, 0), mask=in_grid)
    tl.store(row + 4, tl.where(live, begin_split, 0), mask=in_grid)
    tl.store(row + 5, tl.where(live, first, 0), mask=in_grid)
    tl.store(row + 6, tl.where(live, last, 0), mask=in_grid)
    tl.store(row + 7, zero, mask=in_grid)


def even_blocks_plan(
    seqlens: torch.Tensor, num_parts: int, grid_parts: int, min_blocks: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's (tile_scheduler_metadata [grid_parts, 8], num_splits [b+1]) for device lengths ``seqlens``
    [b] int32, over at most ``num_parts`` parts of at least ``min_blocks`` blocks (the rest empty: the part
    count follows the lengths on the device). One launch, no host sync: capturable in a CUDA graph."""
    if min_blocks < 1:
        raise ValueError(f"min_blocks must be >= 1, got {min_blocks}")
    if seqlens.dtype != torch.int32 or seqlens.ndim != 1 or seqlens.shape[0] == 0:
        raise ValueError(f"seqlens must be a non-empty int32 [b], got {seqlens.dtype} {tuple(seqlens.shape)}")
    if not 1 <= num_parts <= grid_parts:
        raise ValueError(f"num_parts must be in 1..{grid_parts} (the grid's parts), got {num_parts}")
    combine_max_splits(grid_parts)  # raises past the combine's largest instantiation; splits <= num_parts <= it
    check_device("even_blocks_plan", seqlens)
    b = seqlens.shape[0]
    meta = torch.empty(grid_parts, META_INTS, dtype=torch.int32, device=seqlens.device)
    num_splits = torch.empty(b + 1, dtype=torch.int32, device=seqlens.device)
    _even_blocks_plan_kernel[(1,)](
        seqlens.contiguous(),
        meta,
        num_splits,
        b,
        num_parts,
        grid_parts,
        min_blocks,
        PAGE=BLOCK,
        BLOCK_R=min(next_pow2(b), 32),
        BLOCK_P=next_pow2(grid_parts),
        num_warps=8,
        **pdl_kwargs(seqlens, "plan.flashmla_plan"),
    )
    return meta, num_splits


__all__ = [
    "AUTO_MIN_BLOCKS",
    "MIN_BLOCKS_ENV",
    "PARTS_ENV",
    "even_blocks_plan",
    "flashmla_grid_parts",
    "min_blocks_setting",
    "num_parts_for",
    "parts_setting",
]
