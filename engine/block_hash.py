"""Chained block hashes of full pages: the prefix identity shared by every process.

    h_0 = sha256(b"tandem-block-v1" | namespace | 32 zero bytes | tokens_0)
    h_i = sha256(b"tandem-block-v1" | namespace | h_{i-1}     | tokens_i)

``tokens_i`` are the page's token ids as little-endian uint32; ``namespace`` is 32 bytes:
sha256(model fingerprint digest | 0x00 | salt). No Python ``hash()``: equal on every machine.
"""

from __future__ import annotations

import hashlib
import struct

BlockHash = bytes
_TAG = b"tandem-block-v1"
_ROOT = bytes(32)


def namespace(model_digest: str, salt: str = "") -> bytes:
    return hashlib.sha256(model_digest.encode() + b"\x00" + salt.encode()).digest()


def hash_block(ns: bytes, parent: BlockHash | None, tokens: list[int]) -> BlockHash:
    return hashlib.sha256(_TAG + ns + (parent or _ROOT) + struct.pack(f"<{len(tokens)}I", *tokens)).digest()


def block_hashes(ns: bytes, token_ids: list[int], page_size: int) -> list[BlockHash]:
    """Hashes of every *full* page of token_ids (a trailing partial page has none)."""
    out: list[BlockHash] = []
    parent = None
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = hash_block(ns, parent, token_ids[start : start + page_size])
        out.append(parent)
    return out
