"""Triton state checkpoint copy between KDA slots. Contract: kernels/state_copy/naive.py.

Each pool is viewed as ``[num_slots, R, S]`` (recurrent: R = H*K, S = V; conv: R = C, S = conv width).
All pools of one shape go in one launch through a table of base addresses; a program copies a
[BLOCK_R, S] tile of one (pair, layer) with the column shift, loading the whole tile before storing so an
in-place shift (src == dst) is safe.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.state_copy.naive import check_pairs
from kernels.triton_utils import check_device, next_pow2


@triton.jit
def _copy_slots_kernel(
    PTRS,  # [L] int64 base addresses of the pools
    POOL0,  # first pool: element type
    SRC,
    DST,
    SHIFT,
    R,
    S,
    stride_slot,
    HAS_SHIFT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    i_p = tl.program_id(0)
    i_r = tl.program_id(1)
    i_l = tl.program_id(2)
    p_pool = tl.load(PTRS + i_l).to(tl.pointer_type(POOL0.dtype.element_ty))
    src = tl.load(SRC + i_p).to(tl.int64)
    dst = tl.load(DST + i_p).to(tl.int64)
    if HAS_SHIFT:
        shift = tl.load(SHIFT + i_p)
    else:
        shift = 0
    o_r = (i_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    m = (o_r < R)[:, None] & (o_s + shift < S)[None, :]
    b_x = tl.load(p_pool + src * stride_slot + o_r[:, None] * S + (o_s + shift)[None, :], mask=m)
    tl.debug_barrier()  # every thread has read its tile before anyone writes (in-place shift)
    tl.store(p_pool + dst * stride_slot + o_r[:, None] * S + o_s[None, :], b_x, mask=m)


def _copy(pools: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor, shift: torch.Tensor | None) -> None:
    p0 = pools[0]
    for p in pools:
        if p.shape != p0.shape or p.dtype != p0.dtype or p.device != p0.device or not p.is_contiguous():
            raise ValueError("pools of one kind must be contiguous and share shape, dtype and device")
    check_device("copy_state_slots", p0, src)
    r = p0[0].numel() // p0.shape[-1]
    s = p0.shape[-1]
    block_s = next_pow2(s)
    block_r = max(1, min(next_pow2(r), 4096 // block_s))
    ptrs = torch.tensor([p.data_ptr() for p in pools], dtype=torch.int64).to(p0.device, non_blocking=True)
    grid = (src.shape[0], triton.cdiv(r, block_r), len(pools))
    _copy_slots_kernel[grid](
        ptrs,
        p0,
        src,
        dst,
        shift if shift is not None else src,
        r,
        s,
        p0.stride(0),
        HAS_SHIFT=shift is not None,
        BLOCK_R=block_r,
        BLOCK_S=block_s,
        num_warps=4,
    )


def copy_state_slots(
    recurrent: Sequence[torch.Tensor],
    conv: Sequence[torch.Tensor],
    src: Sequence[int],
    dst: Sequence[int],
    conv_shift: Sequence[int] | None = None,
) -> None:
    """Copy KDA state slots ``src[i] -> dst[i]`` in every recurrent and conv pool (in place).

    Args:
        recurrent: per-layer pools [num_slots, H, K, V] (e.g. ``cache.recurrent.values()``); may be empty.
        conv: per-layer pools [num_slots, C, S]; may be empty.
        src, dst: slot ids (host ints; validated: distinct destinations, no destination read by another pair).
        conv_shift: per pair, the conv column shift ``b`` (``num_accepted_tokens - 1``); 0 if None.
    Two launches at most (one per pool kind), whatever the number of layers and pairs.

    Example::

        copy_state_slots(cache.recurrent.values(), cache.conv.values(), [running_slot], [checkpoint_slot])
    """
    src, dst = list(src), list(dst)
    check_pairs(src, dst)
    if conv_shift is not None and len(conv_shift) != len(src):
        raise ValueError(f"{len(conv_shift)} shifts for {len(src)} pairs")
    if not src:
        return
    recurrent, conv = list(recurrent), list(conv)
    device = (recurrent or conv)[0].device
    num_slots = (recurrent or conv)[0].shape[0]
    if any(not 0 <= x < num_slots for x in src + dst):
        raise ValueError(f"slot ids must be in [0, {num_slots}), got src={src} dst={dst}")
    ints = src + dst + (list(conv_shift) if conv_shift is not None else [])
    if conv and conv_shift is not None and any(not 0 <= b < conv[0].shape[-1] for b in conv_shift):
        raise ValueError(f"conv shifts must be in [0, {conv[0].shape[-1]}), got {list(conv_shift)}")
    idx = torch.tensor(ints, dtype=torch.int32).to(device, non_blocking=True)
    n = len(src)
    if recurrent:
        _copy(recurrent, idx[:n], idx[n : 2 * n], None)
    if conv:
        _copy(conv, idx[:n], idx[n : 2 * n], idx[2 * n :] if conv_shift is not None else None)


__all__ = ["copy_state_slots"]
