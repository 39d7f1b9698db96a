"""Tensor <-> checksummed wire pieces (tandem.v1.TensorBytes)."""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from tandem.rpc import prefill_pb2 as pb

DEFAULT_MAX_MESSAGE_BYTES = 1 << 20  # well under gRPC's 4 MiB default message limit


class HandoffError(RuntimeError):
    """The handoff is invalid (corrupt, mismatched, incomplete). Nothing of it may be used."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_pieces(t: torch.Tensor, max_bytes: int) -> Iterator[pb.TensorBytes]:
    # One copy out of the cache (the tensor may be a strided view of pages); pieces are memoryview
    # slices of it, copied once more into each message.
    raw = memoryview(t.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy())
    total = len(raw)
    dtype, shape = dtype_name(t.dtype), list(t.shape)
    for off in range(0, max(total, 1), max_bytes):
        data = raw[off : off + max_bytes]
        yield pb.TensorBytes(
            dtype=dtype, shape=shape, offset=off, total_bytes=total, data=bytes(data), crc32=zlib.crc32(data)
        )


class TensorAssembler:
    """Collects the pieces of one tensor; verifies each piece's checksum, bounds and metadata."""

    def __init__(self, what: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.what = what
        self.dtype = dtype
        self.shape = shape
        self.total = dtype.itemsize * _numel(shape)
        self.buf = bytearray(self.total)
        self.received = 0
        self._offsets: set[int] = set()

    def add(self, piece: pb.TensorBytes) -> int:
        """Verify and place one piece; returns its payload size."""
        data = piece.data  # each read of a bytes field is a copy under upb: read it once
        if zlib.crc32(data) != piece.crc32:
            raise HandoffError(f"{self.what}: checksum mismatch at byte offset {piece.offset}")
        if piece.dtype != dtype_name(self.dtype) or tuple(piece.shape) != self.shape:
            raise HandoffError(
                f"{self.what}: got {piece.dtype}{list(piece.shape)}, "
                f"expected {dtype_name(self.dtype)}{list(self.shape)}"
            )
        if piece.offset in self._offsets:
            raise HandoffError(f"{self.what}: the piece at byte {piece.offset} was received twice")
        self._offsets.add(piece.offset)
        end = piece.offset + len(data)
        if piece.total_bytes != self.total or end > self.total:
            raise HandoffError(f"{self.what}: piece [{piece.offset}, {end}) outside {self.total} bytes")
        self.buf[piece.offset : end] = data
        self.received += len(data)
        return len(data)
        if self.received > self.total:
            raise HandoffError(f"{self.what}: more bytes than the tensor holds (duplicate piece?)")

    def reset(self) -> None:
        """Reuse the buffer for another tensor of the same shape."""
        self.received = 0
        self._offsets.clear()

    @property
    def complete(self) -> bool:
        return self.received == self.total

    def tensor(self) -> torch.Tensor:
        return torch.frombuffer(self.buf, dtype=torch.uint8).view(self.dtype).reshape(self.shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
