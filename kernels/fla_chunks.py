"""fla's varlen chunk tables, built on the host once per step and shared by fla's short conv and KDA kernels.

Both cut each sequence of a varlen batch into 64-token chunks and give every program one (sequence, chunk)
pair: fla's ``prepare_chunk_indices`` / ``prepare_chunk_offsets``. fla builds them per call (on the device
with ``use_graph``: ~12 small kernels; otherwise on the host with a blocking upload); here they come from the
step's host offsets in one pinned, asynchronous upload. Torch only (no fla, no Triton): the CPU engine's
prefix cache reads ``CHUNK`` too.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.upload import Upload, upload

CHUNK = 64
"""fla's tokens per chunk: chunk_kda's chunk size (its intermediate states sit every 64 tokens of a sequence)
and causal_conv1d's tile."""


@dataclass(frozen=True)
class ChunkLayout:
    """A varlen batch's chunk tables for fla's chunk kernels, built on the host once per step.

    fla builds them per call: with ``use_graph`` on the device (~12 small kernels a KDA layer), otherwise on
    the host with a blocking upload. Here they are host-built and uploaded in one pinned, asynchronous copy,
    and every KDA layer of the step reuses them."""

    cu: torch.Tensor  # [N+1] int64 on the device
    cu_cpu: torch.Tensor  # [N+1] int64 on the host (fla reads lengths from it)
    chunk_indices: torch.Tensor  # [NT, 2] int64: (sequence, chunk within it) of each 64-token chunk
    chunk_offsets: torch.Tensor  # [N+1] int64: each sequence's first chunk

    @property
    def num_seqs(self) -> int:
        return self.cu_cpu.numel() - 1

    @property
    def num_chunks(self) -> int:
        return self.chunk_indices.shape[0]


def chunk_layout(cu_seqlens: Sequence[int], device: torch.device | str, up: Upload = upload) -> ChunkLayout:
    """The tables fla's ``prepare_chunk_indices`` / ``prepare_chunk_offsets`` make, for host offsets (``up``:
    a ``StaticUploads`` puts them in a CUDA graph's buffers)."""
    cu = [int(c) for c in cu_seqlens]
    if not cu or cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(f"cu_seqlens must start at 0 and not decrease, got {cu}")
    chunks = [-(-(b - a) // CHUNK) for a, b in itertools.pairwise(cu)]
    offsets = [0, *itertools.accumulate(chunks)]
    pairs = [v for i, c in enumerate(chunks) for j in range(c) for v in (i, j)]
    dev = up(torch.tensor(cu + offsets + pairs, dtype=torch.int64), torch.device(device))
    n = len(cu)
    return ChunkLayout(
        cu=dev[:n],
        cu_cpu=torch.tensor(cu, dtype=torch.int64),
        chunk_indices=dev[2 * n :].view(-1, 2),
        chunk_offsets=dev[n : 2 * n],
    )


__all__ = ["CHUNK", "ChunkLayout", "chunk_layout"]
