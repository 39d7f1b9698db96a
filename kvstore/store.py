"""A worker's side of the prefix tier: files what its engine computes, loads what it can reuse.

Filing runs off the engine thread: the engine hook only copies the filed pages / checkpoints out
(they may be evicted and reused by the very next step); encoding, LMCache puts and index updates
happen on a background thread. Every tier or index failure is logged and counted, never raised to
a request: the request is served without the hit.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field

import torch

from engine.async_engine import AsyncEngine
from engine.block_hash import block_hashes, namespace
from engine.cache.prefix_cache import import_prefix, resident_prefix
from engine.llm_engine import LLMEngine
from kvstore.entry import KIND_KDA, KIND_KV, CorruptEntryError, TierEntry, decode, encode
from kvstore.index import IndexUnavailableError, make_index
from kvstore.tier import LMCacheTier, TierConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixStoreConfig:
    redis_url: str | None = None
    """Shared index + remote tier level; None: in-process index and local tiers only."""
    instance_id: str | None = None
    """How the router knows this worker in the index (default: its bound host:port)."""
    tier: TierConfig = field(default_factory=TierConfig)
    heartbeat_s: float = 5.0


@dataclass
class LoadResult:
    device_pages: int = 0
    tier_pages: int = 0
    """Pages loaded from the tier (beyond those already on the device)."""
    checkpoint_rung: int = 0
    """Pages covered by the KDA checkpoint loaded from the tier (0: none)."""
    bytes: int = 0


class PrefixStore:
    def __init__(self, config: PrefixStoreConfig, engine: LLMEngine, model_tag: str) -> None:
        if engine.prefix_cache is None:
            raise ValueError("the prefix tier needs an engine with enable_prefix_caching")
        self.config = config
        self.engine = engine
        tier_cfg = config.tier
        if config.redis_url and not tier_cfg.remote_url:
            tier_cfg = TierConfig(**{**tier_cfg.__dict__, "remote_url": config.redis_url})
        if tier_cfg.capacity_bytes is None:  # stay under LMCache's own pool so its LRU never fires unseen
            tier_cfg = TierConfig(**{**tier_cfg.__dict__, "capacity_bytes": int(tier_cfg.local_cpu_bytes * 0.8)})
        self.tier = LMCacheTier(tier_cfg, model_tag)
        self.index = make_index(config.redis_url)
        self.tier.on_evict.append(self._on_tier_evict)
        self.counters = {
            k: 0 for k in ("index_errors", "tier_errors", "corrupt_entries", "filed_bytes", "loaded_bytes")
        }
        self.counters.update(tier_hit_tokens=0, device_hit_tokens=0, tier_evictions=0)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._evicted: set[tuple[int, bytes]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefix-filer", daemon=True)
        self._thread.start()
        engine.filing_hooks.append(self._on_filed)
        engine.pages.on_evict.append(lambda h, _page: self._jobs.put(("unclaim", [h])))

    # ---- filing (engine thread -> background thread) -------------------------------------------
    def _on_filed(self, pages: list[tuple[bytes, int]], ckpts: list[tuple[bytes, int]]) -> None:
        cache, prefix = self.engine.cache, self.engine.prefix_cache
        entries = []
        for h, page in pages:
            tokens = list(prefix._tokens_of.get(page, ()))
            entries.append(TierEntry(KIND_KV, h, tokens, [cache.kv[layer][page].clone() for layer in cache.kv]))
        for h, slot in ckpts:
            tensors = []
            for layer in cache.recurrent:
                tensors += [cache.recurrent[layer][slot].clone(), cache.conv[layer][slot].clone()]
            entries.append(TierEntry(KIND_KDA, h, [], tensors))
        self._jobs.put(("file", entries))
        self._jobs.put(("claim", [h for h, _ in pages]))

    def _on_tier_evict(self, kind: int, h: bytes) -> None:
        self.counters["tier_evictions"] += 1
        self._evicted.add((kind, h))
        self._safe_index(lambda: self.index.unpublish(kind, h))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                job, arg = self._jobs.get(timeout=self.config.heartbeat_s)
            except queue.Empty:
                self._safe_index(lambda: self.index.heartbeat(self.config.instance_id))
                continue
            if job == "file":
                self._file(arg)
            elif job == "claim":
                self._safe_index(lambda arg=arg: self.index.claim(self.config.instance_id, arg, True))
            elif job == "unclaim":
                self._safe_index(lambda arg=arg: self.index.claim(self.config.instance_id, arg, False))
            elif job == "barrier":
                arg.set()
            elif job == "stop":
                return

    def _file(self, entries: list[TierEntry]) -> None:
        published = []
        self._evicted = set()
        for e in entries:
            blob = encode(e)
            try:
                self.tier.put(e.kind, e.block_hash, blob)
            except Exception as err:  # a full or failing tier loses a cache entry, not a request
                self.counters["tier_errors"] += 1
                logger.warning("tier put failed: %s", err)
                continue
            self.counters["filed_bytes"] += len(blob)
            published.append((e.kind, e.block_hash, len(blob)))
        # an entry evicted by a later put of the same batch must not be announced
        published = [x for x in published if (x[0], x[1]) not in self._evicted]
        self._safe_index(lambda: self.index.publish(published))

    def _safe_index(self, fn) -> object:
        try:
            return fn()
        except IndexUnavailableError as e:
            self.counters["index_errors"] += 1
            logger.warning("%s", e)
        return None

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is filed (tests, drain)."""
        done = threading.Event()
        self._jobs.put(("barrier", done))
        return done.wait(timeout)

    def close(self) -> None:
        self._jobs.put(("stop", None))
        self._stop.set()
        self._thread.join(timeout=5)
        self.tier.close()
        self.index.close()

    # ---- loading (request path, before the request enters the engine) ---------------------------
    async def load(self, aengine: AsyncEngine, prompt: list[int], cache_salt: str = "") -> LoadResult:
        eng = self.engine
        ps = eng.config.page_size
        ns = namespace(eng.namespace_digest, cache_salt)
        hashes = block_hashes(ns, prompt[: len(prompt) - 1], ps)  # keep one token to compute
        result = LoadResult()
        if not hashes:
            return result
        dev_pages, dev_rung = await aengine.call(lambda e: resident_prefix(e.prefix_cache, hashes, prompt))
        result.device_pages = dev_pages
        self.counters["device_hit_tokens"] += dev_pages * ps
        if dev_pages == len(hashes):
            return result
        fetched = await asyncio.to_thread(self._fetch, hashes, prompt, dev_pages, dev_rung)
        if fetched is None:
            return result
        pages, ckpt, nbytes = fetched
        logger.debug(
            "prefix load: %d/%d pages on device, %d from the tier, checkpoint rung %s",
            dev_pages, len(hashes), len(pages), ckpt[0] if ckpt else None,
        )  # fmt: skip
        if not pages and ckpt is None:
            return result
        await aengine.call(lambda e: import_prefix(e.prefix_cache, e.cache, hashes, prompt, dev_pages, pages, ckpt))
        result.tier_pages, result.bytes = len(pages), nbytes
        result.checkpoint_rung = ckpt[0] if ckpt else 0
        self.counters["tier_hit_tokens"] += len(pages) * ps
        self.counters["loaded_bytes"] += nbytes
        return result

    def _fetch(self, hashes, prompt, first, dev_rung):
        ps = self.engine.config.page_size
        try:
            n_tier = self.index.tier_prefix(hashes)
            logger.debug("index: %d of %d pages in the tier", n_tier, len(hashes))
        except IndexUnavailableError as e:
            self.counters["index_errors"] += 1
            logger.warning("%s: serving without tier hits", e)
            return None
        pages: list[list[torch.Tensor]] = []
        nbytes = 0
        for p in range(first, n_tier):
            entry = self._get(KIND_KV, hashes[p])
            if entry is None or entry.tokens != prompt[p * ps : (p + 1) * ps]:
                break
            pages.append(entry.tensors)
            nbytes += sum(t.numel() * t.element_size() for t in entry.tensors)
        ckpt = None
        prefix = self.engine.prefix_cache
        if prefix.slots is not None:
            rung_pages = prefix.rung_tokens // ps
            for r in range((first + len(pages)) // rung_pages, dev_rung // rung_pages, -1):
                h = hashes[r * rung_pages - 1]
                try:
                    listed = self.index.in_tier(KIND_KDA, [h])[0]
                except IndexUnavailableError:
                    self.counters["index_errors"] += 1
                    break
                entry = self._get(KIND_KDA, h) if listed else None
                if entry is not None:
                    ckpt = (r * rung_pages, entry.tensors)
                    nbytes += sum(t.numel() * t.element_size() for t in entry.tensors)
                    break
        return pages, ckpt, nbytes

    def _get(self, kind: int, h: bytes) -> TierEntry | None:
        try:
            blob = self.tier.get(kind, h)
        except Exception as e:
            self.counters["tier_errors"] += 1
            logger.warning("tier get failed: %s", e)
            return None
        if blob is None:
            return None
        try:
            return decode(blob, h, kind)
        except CorruptEntryError as e:  # never use it; drop it so nobody else trips on it
            self.counters["corrupt_entries"] += 1
            logger.warning("tier entry %s is corrupt (%s): recomputing", h.hex()[:16], e)
            self.tier.remove(kind, h)
            self._safe_index(lambda: self.index.unpublish(kind, h))
            return None
