"""Device-resident prefix cache: full KV pages by block hash, and KDA state checkpoints at rungs.

A rung is every ``rung_pages`` pages (``rung_pages * page_size`` a multiple of the KDA chunk size):
the recurrent + conv state after exactly that many tokens is filed under the hash of the rung's
last page. A hit reuses every matching KV page, and resumes KDA (and so the forward pass) at the
last rung at or below the matched length; the KV of pages between that rung and the match is not
rewritten (see ForwardBatch.kv_write_from).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.block_hash import hash_block
from engine.cache.allocator import BlockAllocator
from engine.cache.tensors import CacheTensors
from engine.request import Request
from kernels.fla_chunks import CHUNK as KDA_CHUNK


@dataclass(frozen=True)
class PrefixHit:
    pages: list[int]
    """Shared pages (references taken), in token order."""
    kv_tokens: int
    """Tokens whose KV is reused (len(pages) * page_size)."""
    resume_tokens: int
    """Where computation resumes: kv_tokens, or the last usable rung for KDA models."""
    checkpoint_slot: int | None
    """Slot to fork the KDA state from (reference taken), None when resume_tokens == 0."""


class PrefixCache:
    def __init__(self, pages: BlockAllocator, slots: BlockAllocator | None, page_size: int, rung_pages: int) -> None:
        if slots is not None and (rung_pages <= 0 or (rung_pages * page_size) % KDA_CHUNK):
            raise ValueError(
                f"kda_checkpoint_pages={rung_pages} x page_size={page_size} must be a positive multiple of "
                f"the KDA chunk size {KDA_CHUNK}"
            )
        self.pages = pages
        self.slots = slots
        self.page_size = page_size
        self.rung_tokens = rung_pages * page_size if slots is not None else 0
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        pages.on_evict.append(lambda _h, page: self._tokens_of.pop(page, None))
        self.hit_tokens = 0
        self.queried_tokens = 0
        self.resume_tokens = 0
        """Sum over hits of where computation resumed (the KDA rung, or the KV hit for attention-only)."""

    # ---- hashing ------------------------------------------------------------------------------
    def hashes_upto(self, req: Request, num_pages: int) -> list[bytes]:
        """The request's chained page hashes, extended to num_pages full pages."""
        ps, hs, ids = self.page_size, req.block_hashes, req.all_token_ids
        while len(hs) < num_pages:
            p = len(hs)
            hs.append(hash_block(req.hash_namespace, hs[-1] if hs else None, ids[p * ps : (p + 1) * ps]))
        return hs

    # ---- lookup -------------------------------------------------------------------------------
    def match(self, req: Request) -> PrefixHit:
        """Longest usable cached prefix of the request; at least one token is left to compute."""
        ps = self.page_size
        max_pages = (req.num_tokens - 1) // ps
        hashes = self.hashes_upto(req, max_pages)
        ids = req.all_token_ids
        pages: list[int] = []
        for p, h in enumerate(hashes):
            page = self.pages.lookup(h)
            if page is None or self._tokens_of.get(page) != tuple(ids[p * ps : (p + 1) * ps]):
                break  # a hash hit is trusted only after its token ids are re-checked
            pages.append(page)
        resume, slot = len(pages) * ps, None
        if self.slots is not None:
            resume = 0
            for rung in range(len(pages) * ps // self.rung_tokens, 0, -1):
                found = self.slots.lookup(hashes[rung * self.rung_tokens // ps - 1])
                if found is not None:
                    resume, slot = rung * self.rung_tokens, found
                    break
        self.pages.share(pages)
        if slot is not None:
            self.slots.share([slot])
        self.queried_tokens += req.num_tokens
        self.hit_tokens += len(pages) * ps
        self.resume_tokens += resume
        return PrefixHit(pages, len(pages) * ps, resume, slot)

    def release(self, hit: PrefixHit) -> None:
        self.pages.free(hit.pages)
        if hit.checkpoint_slot is not None:
            self.slots.free([hit.checkpoint_slot])

    # ---- filing -------------------------------------------------------------------------------
    def rungs_in(self, start: int, end: int) -> list[int]:
        """Rung positions (token counts) in (start, end]."""
        if not self.rung_tokens:
            return []
        first = (start // self.rung_tokens + 1) * self.rung_tokens
        return list(range(first, end + 1, self.rung_tokens))

    def file_pages(self, req: Request, start: int, end: int) -> list[tuple[bytes, int]]:
        """File pages that became full in (start, end]; returns the newly filed (hash, page)."""
        ps = self.page_size
        first, last = max(start // ps, req.kv_cached_tokens // ps), end // ps
        hashes = self.hashes_upto(req, last)
        ids = req.all_token_ids
        filed = []
        for p in range(first, last):
            page = req.page_ids[p]
            if self.pages.register(page, hashes[p]):
                self._tokens_of[page] = tuple(ids[p * ps : (p + 1) * ps])
                filed.append((hashes[p], page))
        return filed

    def file_checkpoint(self, req: Request, pos: int, slot: int) -> bytes | None:
        """File the state written to `slot` at rung `pos`; the request drops its reference."""
        h = self.hashes_upto(req, pos // self.page_size)[pos // self.page_size - 1]
        filed = self.slots.register(slot, h)
        self.slots.free([slot])  # filed: cached at count 0; a duplicate: back to the free list
        return h if filed else None

    def checkpoint_exists(self, req: Request, pos: int) -> bool:
        h = self.hashes_upto(req, pos // self.page_size)[pos // self.page_size - 1]
        return self.slots is not None and self.slots.lookup(h) is not None


def resident_prefix(prefix: PrefixCache, hashes: list[bytes], token_ids: list[int]) -> tuple[int, int]:
    """(leading pages resident with matching tokens, last rung with a resident checkpoint), no refs taken."""
    ps, n = prefix.page_size, 0
    for p, h in enumerate(hashes):
        page = prefix.pages.lookup(h)
        if page is None or prefix._tokens_of.get(page) != tuple(token_ids[p * ps : (p + 1) * ps]):
            break
        n += 1
    rung = 0
    if prefix.slots is not None:
        rung_pages = prefix.rung_tokens // ps
        for r in range(n // rung_pages, 0, -1):
            if prefix.slots.lookup(hashes[r * rung_pages - 1]) is not None:
                rung = r * rung_pages
                break
    return n, rung


def import_prefix(
    prefix: PrefixCache,
    cache: CacheTensors,
    hashes: list[bytes],
    token_ids: list[int],
    first_page: int,
    pages: list[list[torch.Tensor]],
    checkpoint: tuple[int, list[torch.Tensor]] | None,
) -> int:
    """Write pages fetched from the tier (page first_page + i gets pages[i], one tensor per attention
    layer) and a rung checkpoint (rung page count, [recurrent, conv] per KDA layer) into the device
    cache, filed and unreferenced (evictable). Returns how many leading pages are now resident."""
    ps = prefix.page_size
    for i, tensors in enumerate(pages):
        p = first_page + i
        if prefix.pages.lookup(hashes[p]) is not None:
            continue
        if not prefix.pages.can_allocate(1):
            return p
        (page,) = prefix.pages.allocate(1)
        for layer, t in zip(cache.kv, tensors, strict=True):
            cache.kv[layer][page] = t
        prefix.pages.register(page, hashes[p])
        prefix._tokens_of[page] = tuple(token_ids[p * ps : (p + 1) * ps])
        prefix.pages.free([page])
    if checkpoint is not None and prefix.slots is not None:
        rung_pages, tensors = checkpoint
        h = hashes[rung_pages - 1]
        if prefix.slots.lookup(h) is None and prefix.slots.can_allocate(1):
            (slot,) = prefix.slots.allocate(1)
            for j, layer in enumerate(cache.recurrent):
                cache.recurrent[layer][slot] = tensors[2 * j]
                cache.conv[layer][slot] = tensors[2 * j + 1]
            prefix.slots.register(slot, h)
            prefix.slots.free([slot])
    return first_page + len(pages)
