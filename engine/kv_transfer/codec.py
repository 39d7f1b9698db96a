"""Tensor <-> checksummed wire pieces (tandem.v1.TensorBytes)."""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Iterator

import torch

# zlib-ng's CRC-32 is zlib's (same polynomial, same values; tests check it) at ~10x the speed of the system
# zlib here (carry-less multiply instead of tables): at zlib's speed the receiver's CRC alone cost more CPU
# than the gRPC transport. It releases the GIL on large buffers.
from zlib_ng.zlib_ng import crc32

from tandem.rpc import prefill_pb2 as pb

DEFAULT_MAX_MESSAGE_BYTES = 1 << 20  # well under gRPC's 4 MiB default message limit


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
        self, what: str, dtype: torch.dtype, shape: tuple[int, ...], segments: list[memoryview] | None = None
    ) -> None:
        self.what = what
        self.dtype = dtype
        self.shape = shape
        self.total = dtype.itemsize * _numel(shape)
        self.buf = bytearray(self.total) if segments is None else None
        self.segments = [memoryview(self.buf)] if segments is None else segments
        self._starts = [0]
        for seg in self.segments:
            self._starts.append(self._starts[-1] + len(seg))
        if self._starts[-1] != self.total:
            raise ValueError(f"{what}: segments hold {self._starts[-1]} bytes, the tensor {self.total}")
        self.received = 0
        self._spans: list[tuple[int, int]] = []  # sorted (start, end) of the pieces received

    def add(self, piece: pb.TensorBytes, data: bytes | memoryview | None = None) -> int:
        """Verify and place one piece; returns its payload size. ``data``: the piece's payload where it was
        received apart from the message (wire.ReceivedChunk), else ``piece.data``."""
        if data is None:
            data = piece.data  # each read of a bytes field is a copy under upb: read it once
        if crc32(data) != piece.crc32:
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
        i = bisect_right(self._starts, offset) - 1
        done = 0
        while done < len(data):
            seg, at = self.segments[i], offset + done - self._starts[i]
            n = min(len(seg) - at, len(data) - done)
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


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
