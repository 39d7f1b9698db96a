"""Reference state checkpoint copy between KDA slots (prefix-cache forks, spec-decode commits).

Pools: recurrent ``[num_slots, H, K, V]`` and conv ``[num_slots, C, S]`` (S = W-1, or W-1+num_spec with
speculative decoding), one of each per KDA layer. For each pair ``(src[i], dst[i])``:

    recurrent:  pool[dst] = pool[src]
    conv:       pool[dst, :, :S - b] = pool[src, :, b:]     with b = conv_shift[i] (default 0)

The shift is vLLM's "align"-mode ``token_bias = num_accepted_tokens - 1``: after a verify step the committed
window starts at column ``num_accepted - 1`` (kernels/short_conv/naive_spec.py), and the copy moves it to
column 0. Columns ``S - b ..`` of the destination are left as they were. The caller picks the recurrent
source slot itself (the per-token slot of the last accepted token).

Rules: destinations are distinct, and no destination is the source of another pair (``src == dst`` in one
pair is allowed: an in-place shift).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_pairs(src: Sequence[int], dst: Sequence[int]) -> None:
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} sources but {len(dst)} destinations")
    if len(set(dst)) != len(dst):
        raise ValueError(f"destination slots must be distinct, got {list(dst)}")
    for i, d in enumerate(dst):
        if any(s == d and j != i for j, s in enumerate(src)):
            raise ValueError(f"slot {d} is both a destination and the source of another pair")


def naive_copy_state_slots(
    recurrent: Sequence[torch.Tensor],
    conv: Sequence[torch.Tensor],
    src: Sequence[int],
    dst: Sequence[int],
    conv_shift: Sequence[int] | None = None,
) -> None:
    check_pairs(src, dst)
    shifts = list(conv_shift) if conv_shift is not None else [0] * len(src)
    for pool in recurrent:
        for s, d in zip(src, dst, strict=True):
            pool[d] = pool[s].clone()
    for pool in conv:
        width = pool.shape[-1]
        for s, d, b in zip(src, dst, shifts, strict=True):
            pool[d, :, : width - b] = pool[s, :, b:].clone()
