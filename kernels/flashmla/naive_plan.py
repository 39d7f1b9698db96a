"""Reference split plans for FlashMLA's dense decode, and a checker of what its kernels assume of a plan.

A plan is what FlashMLA's split kernel and combine read (csrc/params.h, DecodingSchedMeta):

    tile_scheduler_metadata [grid_parts, 8] int32, one row per part (one CTA column of the split kernel):
        begin_req, end_req         requests the part walks, both inclusive (begin_req >= b: an empty part)
        begin_block, end_block     key blocks (pages of 64) of begin_req from begin_block, of end_req up to
                                   end_block (exclusive); the requests between are walked whole
        begin_split                which split of begin_req this part is (the others' parts are their split 0)
        first_split, last_split    begin_req / end_req is split over several parts (0 / 1): its partial output
                                   goes to the accumulators at row num_splits[r] + split, else straight out
        pad
    num_splits [b+1] int32, cumulative: request r owns accumulator rows num_splits[r] .. num_splits[r+1] - 1;
        a request with one split is written by the split kernel and skipped by the combine.

A request of n tokens has max(1, ceil(n / 64)) blocks: FlashMLA counts an empty one as one block it never
splits, and ends it at block 0 (its split kernel loads block 0's page but reads no key).

``naive_plan`` is the "even blocks" policy of kernels/flashmla/plan.py (its contract), ``flashmla_reference_plan``
a transcription of FlashMLA's own planner (smxx/decode/get_decoding_sched_meta), ``plan_errors`` the checker.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BLOCK = 64  # FlashMLA's key block: one page
META_INTS = 8  # sizeof(DecodingSchedMeta) / 4
FLASHMLA_OVERHEAD = 5  # fixed_overhead_num_blocks, as dense_decode.h passes it: a request's cost beyond its blocks
BEGIN_REQ, END_REQ, BEGIN_BLOCK, END_BLOCK, BEGIN_SPLIT, FIRST_SPLIT, LAST_SPLIT = range(7)


def combine_max_splits(grid_parts: int) -> int:
    """MAX_SPLITS of the combine kernel FlashMLA instantiates for ``grid_parts`` (combine.cu's
    MLA_NUM_SPLITS_SWITCH on num_sm_parts): no request may have more splits than this."""
    for cap in (32, 64, 96, 128, 160):
        if grid_parts <= cap:
            return cap
    raise ValueError(f"FlashMLA's combine takes at most 160 parts, got {grid_parts}")


def request_blocks(seqlens: Sequence[int]) -> list[int]:
    """Key blocks per request as FlashMLA counts them: an empty request is one block."""
    return [max(1, -(-max(int(n), 0) // BLOCK)) for n in seqlens]


def _lens(seqlens: torch.Tensor | Sequence[int]) -> list[int]:
    return [int(n) for n in (seqlens.tolist() if isinstance(seqlens, torch.Tensor) else seqlens)]


def naive_plan(
    seqlens: torch.Tensor | Sequence[int], num_parts: int, grid_parts: int, min_blocks: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The "even blocks" plan: the requests' blocks laid end to end, part i taking blocks [i q, (i+1) q) with
    q = max(ceil(total / num_parts), min_blocks); parts past the end are empty (so short contexts use fewer
    parts: a part's fixed cost is paid over at least ``min_blocks`` blocks). Returns (meta [grid_parts, 8],
    num_splits [b+1])."""
    lens = _lens(seqlens)
    b = len(lens)
    if b == 0 or not 1 <= num_parts <= grid_parts:
        raise ValueError(f"need a non-empty batch and 1 <= num_parts <= {grid_parts}, got b={b}, {num_parts}")
    n = request_blocks(lens)
    starts = [sum(n[:r]) for r in range(b)]  # global index of each request's first block
    total = sum(n)
    if min_blocks < 1:
        raise ValueError(f"min_blocks must be >= 1, got {min_blocks}")
    q = max(-(-total // num_parts), min_blocks)
    splits = [(starts[r] + n[r] - 1) // q - starts[r] // q + 1 for r in range(b)]  # parts touching r
    num_splits = [0]
    for k in splits:
        num_splits.append(num_splits[-1] + k)

    def request_of(block: int) -> int:
        return max(r for r in range(b) if starts[r] <= block)

    meta = [[b, b - 1, 0, 0, 0, 0, 0, 0] for _ in range(grid_parts)]  # empty parts
    for i in range(grid_parts):
        lo, hi = i * q, min((i + 1) * q, total)
        if lo >= total:
            continue
        rb, re = request_of(lo), request_of(hi - 1)
        end_block = 0 if lens[re] <= 0 else hi - starts[re]
        first, last = int(splits[rb] > 1), int(splits[re] > 1)
        meta[i] = [rb, re, lo - starts[rb], end_block, i - starts[rb] // q, first, last, 0]
    return torch.tensor(meta, dtype=torch.int32), torch.tensor(num_splits, dtype=torch.int32)


def flashmla_reference_plan(
    seqlens: torch.Tensor | Sequence[int], num_sm_parts: int, block: int = BLOCK, overhead: int = FLASHMLA_OVERHEAD
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's own planner (get_mla_metadata_kernel, dense: first block 0), line for line: each part takes
    ceil(total / parts) + overhead blocks' worth of payload, a request costing its blocks + overhead. Empty parts'
    begin_block is shared-memory junk there (a read past the first-block array); 0 here."""
    lens = _lens(seqlens)
    b = len(lens)
    last_block = [max(n - 1, 0) // block for n in lens]  # an empty request: block 0, as a one-token one
    num_blocks = [lb + 1 for lb in last_block]
    total = sum(nb + overhead for nb in num_blocks)
    payload = -(-total // num_sm_parts) + overhead
    req, now_block, split, cum = 0, 0, 0, 0
    num_splits = [0] * (b + 1)
    meta = []
    for _ in range(num_sm_parts):
        row = [req, 0, now_block if req < b else 0, 0, split, int(now_block != 0), 0, 0]
        remain = payload
        while req < b:
            left = num_blocks[req] - now_block
            if remain >= left + overhead:
                cum += split + 1
                num_splits[req + 1] = cum
                remain -= left + overhead
                req, now_block, split = req + 1, 0, 0
            else:
                if remain - overhead > 0:
                    now_block += remain - overhead
                    split += 1
                break
        end = req if now_block > 0 else req - 1
        row[END_REQ] = end
        if now_block > 0:
            row[END_BLOCK] = now_block
        else:
            row[END_BLOCK] = 0 if lens[req - 1] == 0 else last_block[req - 1] + 1
        row[LAST_SPLIT] = int(row[END_BLOCK] != last_block[end] + 1 and lens[end] != 0)
        if row[BEGIN_REQ] == end:
            row[FIRST_SPLIT] = row[LAST_SPLIT] = int(bool(row[FIRST_SPLIT] or row[LAST_SPLIT]))
        meta.append(row)
    assert req == b and now_block == 0 and split == 0, "FlashMLA's FLASH_DEVICE_ASSERT"
    return torch.tensor(meta, dtype=torch.int32), torch.tensor(num_splits, dtype=torch.int32)


def plan_errors(
    meta: torch.Tensor, num_splits: torch.Tensor, seqlens: torch.Tensor | Sequence[int], grid_parts: int
) -> list[str]:
    """What is wrong with a plan for these lengths (empty: FlashMLA's kernels compute exact attention with it).

    Every block of every request covered exactly once, in part order, by non-empty ranges (an empty request:
    one [0, 0) range); a request's splits numbered 0, 1, ... in part order and counted by num_splits; its
    partial outputs sent to the accumulators iff it has more than one split (the combine skips one-split
    requests); at most combine_max_splits(grid_parts) splits a request, at most b + grid_parts in all (the
    accumulators' rows); empty parts start at request b (the split kernel returns on begin_req >= b)."""
    lens = _lens(seqlens)
    b, errs = len(lens), []
    meta, num_splits = meta.cpu(), num_splits.cpu()
    if tuple(meta.shape) != (grid_parts, META_INTS) or tuple(num_splits.shape) != (b + 1,):
        return [f"shapes {tuple(meta.shape)} / {tuple(num_splits.shape)}, want ({grid_parts}, 8) / ({b + 1},)"]
    cum = num_splits.tolist()
    counts = [cum[r + 1] - cum[r] for r in range(b)]
    if cum[0] != 0:
        errs.append(f"num_splits[0] = {cum[0]}")
    if cum[b] > b + grid_parts:
        errs.append(f"{cum[b]} splits in all, the accumulators hold {b + grid_parts}")
    cap = combine_max_splits(grid_parts)
    errs += [f"request {r}: {k} splits (combine's MAX_SPLITS is {cap})" for r, k in enumerate(counts) if k > cap]
    n_blocks = [-(-max(n, 0) // BLOCK) for n in lens]
    seen: list[list[tuple[int, int, int, bool]]] = [[] for _ in range(b)]  # (begin, end, split, to accumulators)
    for i, row in enumerate(meta.tolist()):
        rb, re, bb, eb, bs, fs, ls = row[:7]
        if rb >= b:
            if rb != b:
                errs.append(f"part {i}: empty with begin_req {rb} (FlashMLA writes b = {b})")
            continue
        if not 0 <= rb <= re < b:
            errs.append(f"part {i}: requests {rb}..{re} out of order or range (b = {b})")
            continue
        for r in range(rb, re + 1):
            lo = bb if r == rb else 0
            hi = eb if r == re else n_blocks[r]
            split = bs if r == rb else 0
            accum = bool(fs) if r == rb else bool(ls) if r == re else False
            seen[r].append((lo, hi, split, accum))
        if rb == re and fs != ls:
            errs.append(f"part {i}: one request but flags {fs} / {ls}")
    for r, segs in enumerate(seen):
        at = 0
        for j, (lo, hi, split, accum) in enumerate(segs):
            if lo != at or not (hi > lo or (n_blocks[r] == 0 and hi == lo == 0)):
                errs.append(f"request {r}: range [{lo}, {hi}) after block {at}")
            if split != j:
                errs.append(f"request {r}: split index {split} for its split {j}")
            if accum != (len(segs) > 1):
                errs.append(f"request {r}: {len(segs)} splits but a part sends it to the accumulators={accum}")
            at = max(hi, at)
        if at != n_blocks[r] or not segs:
            errs.append(f"request {r}: blocks covered up to {at} of {n_blocks[r]}")
        if len(segs) != counts[r]:
            errs.append(f"request {r}: {len(segs)} parts touch it, num_splits says {counts[r]}")
    return errs


__all__ = [
    "BLOCK",
    "FLASHMLA_OVERHEAD",
    "META_INTS",
    "combine_max_splits",
    "flashmla_reference_plan",
    "naive_plan",
    "plan_errors",
    "request_blocks",
]
