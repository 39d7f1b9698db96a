"""Tier entries: a self-describing, checksummed envelope around a page's KV or a rung's KDA state.

    magic "TDM1" | kind u8 | hash 32B | n_tokens u32 | tokens u32[n] | n_tensors u32 |
    per tensor: dtype u8, ndim u8, dims u32[ndim] | payload crc32 u32 | payload

The full 32-byte hash and the page's token ids are inside, so a hit is checked against both, and a
corrupted entry is detected (and treated as a miss) before anything reaches the cache.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch

MAGIC = b"TDM1"
KIND_KV, KIND_KDA = 1, 2
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]


class CorruptEntryError(ValueError):
    pass


@dataclass
class TierEntry:
    kind: int
    block_hash: bytes
    tokens: list[int]
    tensors: list[torch.Tensor]


def encode(entry: TierEntry) -> bytes:
    head = [MAGIC, struct.pack("<B", entry.kind), entry.block_hash, struct.pack("<I", len(entry.tokens))]
    head.append(struct.pack(f"<{len(entry.tokens)}I", *entry.tokens))
    head.append(struct.pack("<I", len(entry.tensors)))
    payload = []
    for t in entry.tensors:
        head.append(struct.pack("<BB", _DTYPES.index(t.dtype), t.dim()) + struct.pack(f"<{t.dim()}I", *t.shape))
        payload.append(t.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy().tobytes())
    body = b"".join(payload)
    return b"".join(head) + struct.pack("<I", zlib.crc32(body)) + body


def decode(blob: bytes, expect_hash: bytes, expect_kind: int) -> TierEntry:
    try:
        if blob[:4] != MAGIC:
            raise CorruptEntryError("bad magic")
        off = 4
        (kind,) = struct.unpack_from("<B", blob, off)
        h = blob[off + 1 : off + 33]
        off += 33
        (n,) = struct.unpack_from("<I", blob, off)
        tokens = list(struct.unpack_from(f"<{n}I", blob, off + 4))
        off += 4 + 4 * n
        (nt,) = struct.unpack_from("<I", blob, off)
        off += 4
        specs = []
        for _ in range(nt):
            dt, nd = struct.unpack_from("<BB", blob, off)
            shape = struct.unpack_from(f"<{nd}I", blob, off + 2)
            off += 2 + 4 * nd
            specs.append((_DTYPES[dt], shape))
        (crc,) = struct.unpack_from("<I", blob, off)
        body = memoryview(blob)[off + 4 :]
    except (struct.error, IndexError) as e:
        raise CorruptEntryError(f"truncated entry: {e}") from e
    if zlib.crc32(body) != crc:
        raise CorruptEntryError("payload checksum mismatch")
    if h != expect_hash or kind != expect_kind:
        raise CorruptEntryError("entry is filed under another hash or kind")
    tensors, pos = [], 0
    for dtype, shape in specs:
        nbytes = dtype.itemsize * _numel(shape)
        if pos + nbytes > len(body):
            raise CorruptEntryError("payload shorter than its tensors")
        raw = torch.frombuffer(bytearray(body[pos : pos + nbytes]), dtype=torch.uint8)
        tensors.append(raw.view(dtype).reshape(shape))
        pos += nbytes
    return TierEntry(kind, h, tokens, tensors)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
