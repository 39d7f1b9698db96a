"""Tensor <-> checksummed wire pieces (tandem.v1.TensorBytes)."""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Iterator

import numpy as np
import torch

# zlib-ng's CRC-32 is zlib's (same polynomial, same values; tests check it) at ~10x the speed of the system
# zlib here (carry-less multiply instead of tables): at zlib's speed the receiver's CRC alone cost more CPU
# than the gRPC transport. It releases the GIL on large buffers.
from zlib_ng.zlib_ng import crc32

from tandem.rpc import prefill_pb2 as pb

DEFAULT_MAX_MESSAGE_BYTES = 1 << 20  # well under gRPC's 4 MiB default message limit
_UNLOCKED_COPY_BYTES = 64 << 10
"""Pieces at least this large are copied by numpy, which releases the GIL (a memoryview assignment holds it):
a socket lane's receiving thread keeps reading while another places (engine/kv_transfer/socket_lanes.py)."""


class HandoffError(RuntimeError):
    """The handoff is invalid (corrupt, mismatched, incomplete). Nothing of it may be used."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, flat; a copy only where it is not a contiguous CPU tensor (a strided view of
    pages, a device tensor)."""
    return memoryview(t.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy())


def tensor_pieces(t: torch.Tensor, max_bytes: int) -> Iterator[tuple[pb.TensorBytes, memoryview]]:
    """(piece without its data, the data) for each at most max_bytes of the tensor; wire.encode_chunk
    puts them in a message with one copy of the data."""
    raw = tensor_bytes(t)
    total = len(raw)
    dtype, shape = dtype_name(t.dtype), list(t.shape)
    for off in range(0, max(total, 1), max_bytes):
        data = raw[off : off + max_bytes]
        yield pb.TensorBytes(dtype=dtype, shape=shape, offset=off, total_bytes=total, crc32=crc32(data)), data


class TensorAssembler:
    """Collects the pieces of one tensor; verifies each piece's checksum, bounds and metadata before
    writing any of it.

    ``segments``: writable byte views that together are the tensor's bytes, in order (its pages in the
    cache), so pieces land where they are used with one copy. Default: one host buffer, read with tensor().
    """

    def __init__(
        self,
        what: str,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        segments: list[memoryview] | None = None,
        pages: PagedTarget | None = None,
    ) -> None:
        self.what = what
        self.dtype = dtype
        self.shape = shape
        self.total = dtype.itemsize * _numel(shape)
        self.pages = pages
        if pages is not None:
            segments = []  # the pages are the target
            if pages.total != self.total:
                raise ValueError(f"{what}: pages hold {pages.total} bytes, the tensor {self.total}")
        self.buf = bytearray(self.total) if segments is None else None
        self.segments = [memoryview(self.buf)] if segments is None else segments
        self._starts = [0]
        for seg in self.segments:
            self._starts.append(self._starts[-1] + len(seg))
        if pages is None and self._starts[-1] != self.total:
            raise ValueError(f"{what}: segments hold {self._starts[-1]} bytes, the tensor {self.total}")
        self.received = 0
        self._spans: list[tuple[int, int]] = []  # sorted (start, end) of the pieces received

    def add(self, piece: pb.TensorBytes, data: bytes | memoryview | None = None, crc: int | None = None) -> int:
        """Verify and place one piece; returns its payload size. ``data``: the piece's payload where it was
        received apart from the message (wire.ReceivedChunk), else ``piece.data``; ``crc``: data's CRC-32
        where the receiver computed it already."""
        if data is None:
            data = piece.data  # each read of a bytes field is a copy under upb: read it once
        if (crc32(data) if crc is None else crc) != piece.crc32:
            raise HandoffError(f"{self.what}: checksum mismatch at byte offset {piece.offset}")
        if piece.dtype != dtype_name(self.dtype) or tuple(piece.shape) != self.shape:
            raise HandoffError(
                f"{self.what}: got {piece.dtype}{list(piece.shape)}, "
                f"expected {dtype_name(self.dtype)}{list(self.shape)}"
            )
        n = len(data)
        start, end = piece.offset, piece.offset + n
        if piece.total_bytes != self.total or end > self.total:
            raise HandoffError(f"{self.what}: piece [{start}, {end}) outside {self.total} bytes")
        self._claim(start, end)
        self._write(start, memoryview(data))
        self.received += n
        return n

    def _claim(self, start: int, end: int) -> None:
        """Pieces must not overlap: then ``received == total`` means every byte was written."""
        i = bisect_right(self._spans, (start, end))
        for other in self._spans[max(i - 1, 0) : i + 1]:
            if other[0] == start:
                raise HandoffError(f"{self.what}: the piece at byte {start} was received twice")
            if other[0] < end and start < other[1]:
                raise HandoffError(f"{self.what}: piece [{start}, {end}) overlaps [{other[0]}, {other[1]})")
        insort(self._spans, (start, end))

    def _write(self, offset: int, data: memoryview) -> None:
        if self.pages is not None:
            self.pages.write(offset, data)
            return
        i = bisect_right(self._starts, offset) - 1
        done = 0
        while done < len(data):
            seg, at = self.segments[i], offset + done - self._starts[i]
            n = min(len(seg) - at, len(data) - done)
            if n >= _UNLOCKED_COPY_BYTES:
                np.copyto(np.frombuffer(seg[at : at + n], np.uint8), np.frombuffer(data[done : done + n], np.uint8))
            else:
                seg[at : at + n] = data[done : done + n]
            done += n
            i += 1

    def reset(self) -> None:
        """Reuse the buffer for another tensor of the same shape."""
        self.received = 0
        self._spans.clear()

    @property
    def complete(self) -> bool:
        return self.received == self.total

    def tensor(self) -> torch.Tensor:
        if self.buf is None:
            raise RuntimeError(f"{self.what}: assembled in place, not in a buffer")
        return torch.frombuffer(self.buf, dtype=torch.uint8).view(self.dtype).reshape(self.shape)


class PagedTarget:
    """A tensor whose bytes are whole pages of a pool, in order (the last one possibly partial): a kv part
    written straight into its reserved pages. A piece's whole pages go in one indexed numpy assignment,
    which releases the GIL (a page at a time from Python cost as much CPU as the copy itself)."""

    def __init__(self, pool: np.ndarray, page_ids: np.ndarray, total: int) -> None:
        """``pool``: [pages, page_bytes] uint8 (the cache layer's bytes); ``page_ids``: this tensor's pages."""
        self.pool, self.ids, self.total = pool, page_ids, total
        self.page_bytes = pool.shape[1]
        if not 0 <= total <= len(page_ids) * self.page_bytes or total <= (len(page_ids) - 1) * self.page_bytes:
            raise ValueError(f"{total} bytes do not fill {len(page_ids)} pages of {self.page_bytes}")

    def write(self, offset: int, data: memoryview | bytes) -> None:
        src = np.frombuffer(data, np.uint8)
        pb, n = self.page_bytes, len(src)
        page, at = divmod(offset, pb)
        pos = 0
        if at:  # the piece begins inside a page
            pos = min(pb - at, n)
            self.pool[self.ids[page], at : at + pos] = src[:pos]
            page += 1
        whole = (n - pos) // pb
        if whole:
            self.pool[self.ids[page : page + whole]] = src[pos : pos + whole * pb].reshape(whole, pb)
            pos += whole * pb
            page += whole
        if pos < n:  # it ends inside a page
            self.pool[self.ids[page], : n - pos] = src[pos:]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
