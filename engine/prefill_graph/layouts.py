"""Steps whose KDA layout repeats: their KDA cores go inside the graph pieces.

The pieces leave the KDA short conv and recurrence eager because their launches follow the step's sequence
layout. But many steps share a layout: every full chunk of a long prompt after the first (one sequence of
``max_num_batched_tokens`` rows, from a state), every first chunk, a benchmark's repeated prompt. For those,
the KDA backend names the layout (``layout_key``: chunk lengths and which chunks start from a state) and can
write a step's metadata — slots, offsets, fla's chunk tables — into fixed device buffers (``bind_static``).
A layout seen twice is captured once with its KDA cores inside the pieces, over those buffers; each later step
with it refills them and replays. Only attention (its launches follow the prefix length too) and the hooks
stay between the pieces. An eager KDA core launches ~15 Triton kernels through fla's Python wrappers (3 ms of
host a layer on an H200 host, bench/prefill_host.py), more than its GPU time at 8k tokens: the GPU waited.

Bounded: only the first ``max_layouts`` layouts seen are tracked, and of those the ones seen again get graphs
(a layout seen once is likely a one-off); other steps take the bucket's pieces. A failed layout capture turns
layouts off for good (the pieces stay on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.forward_batch import ForwardBatch
from kernels.upload import StaticUploads

DEFAULT_MAX_LAYOUTS = 8


@dataclass(frozen=True)
class KDALayout:
    key: tuple
    batch: ForwardBatch
    """The layout's sequences over the first rows of the static buffers, each on the scratch slot: what the
    KDA cores are captured with (``bind_static`` puts a real step's slots under it)."""
    uploads: StaticUploads


class LayoutBook:
    """Which layouts have been seen, and the ones with graphs."""

    def __init__(self, max_layouts: int = DEFAULT_MAX_LAYOUTS) -> None:
        self.max_layouts = max_layouts
        self.enabled = max_layouts > 0
        self._seen: set[tuple] = set()
        self._layouts: dict[tuple, KDALayout] = {}

    def lookup(self, kda: Any, batch: ForwardBatch, make_batch: Any) -> KDALayout | None:
        """The step's layout when it has (or, seen before, now gets) graphs; None: the bucket's pieces.
        ``make_batch(key) -> ForwardBatch`` builds the capture batch of a new layout."""
        key_of = getattr(kda, "layout_key", None)
        if not self.enabled or key_of is None:
            return None
        key = key_of(batch)
        if key is None:
            return None
        if key in self._layouts:
            return self._layouts[key]
        if key not in self._seen:
            if len(self._seen) < self.max_layouts:
                self._seen.add(key)
            return None
        return self._add(key, make_batch)

    def register(self, key: tuple, make_batch: Any) -> KDALayout | None:
        """A layout known to repeat (a long prompt's full chunks), given graphs before it is seen; None when
        layouts are off or the bound is reached."""
        if not self.enabled:
            return None
        if key in self._layouts:
            return self._layouts[key]
        if key not in self._seen and len(self._seen) >= self.max_layouts:
            return None
        self._seen.add(key)
        return self._add(key, make_batch)

    def _add(self, key: tuple, make_batch: Any) -> KDALayout:
        layout = KDALayout(key, make_batch(key), StaticUploads())
        self._layouts[key] = layout
        return layout


def capture_batch(key: tuple, input_ids: torch.Tensor, positions: torch.Tensor, slot: int) -> ForwardBatch:
    """A ForwardBatch of ``key``'s sequences (``GPUKDABackend.layout_key``) on the first rows of the static
    buffers, every sequence on the scratch ``slot``: only the KDA cores see it."""
    q_lens, has_init = key
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    n, dev = qsl[-1], input_ids.device
    return ForwardBatch(
        input_ids=input_ids[:n],
        positions=positions[:n],
        query_start_loc=qsl,
        context_lens=list(q_lens),
        block_tables=[torch.zeros(0, dtype=torch.int64, device=dev) for _ in q_lens],
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev),
        state_slots=[slot] * len(q_lens),
        has_initial_state=list(has_init),
        logits_indices=torch.zeros(0, dtype=torch.int64, device=dev),
        request_ids=[f"prefill-layout-capture-{i}" for i in range(len(q_lens))],
        chunk_starts=[0] * len(q_lens),
        completes_prompt=[False] * len(q_lens),
        checkpoints=[()] * len(q_lens),
    )


__all__ = ["DEFAULT_MAX_LAYOUTS", "KDALayout", "LayoutBook", "capture_batch"]
