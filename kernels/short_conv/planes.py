"""A long prefill's q | k | v short conv in one launch: conv + SiLU, and q / k L2-normalised per head.

Contract: ``naive_short_conv`` for the conv (its windows read from the state slots, not written: the caller
runs ``write_windows`` after, as for fla's conv), then ``kernels.kda.naive.l2norm`` of each ``head_dim``
channels of the first ``norm_planes`` planes, on the conv output rounded to its dtype (the numerics of a
separate conv then L2 norm: fla's ``l2norm_fwd``, ``1 / sqrt(sum(x^2) + eps)``).

Why: an 8k-token Kimi prefill ran fla's ``causal_conv1d`` (three planes, ~54 us each, ~60 % of copy
bandwidth) and then fla's ``l2norm_fwd`` on q and k (~33 us each) in every KDA layer; the norm re-read and
re-wrote q and k. Here one program owns one (64-token tile of a sequence, one head of one plane): the tile's
rows and the three rows before it are read once per tap from L1 / L2, the norm runs on the accumulator, and
only y is written. The tiles are fla's chunk table (``kernels/fla_chunks.py``), so a tile never crosses
sequences, and the table is the one the step already built for the KDA kernels. A tile is walked in ``block_t``
-row sub-tiles: the whole [64 x 128] tile took 255 registers a thread and spilled (ptxas, sm_90); 8 rows at 2
warps ran fastest on the H200 (``bench/conv_planes.py``: 248 vs 284 us for the path it replaces at 8k tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fla_chunks import CHUNK
from kernels.short_conv.fla_adapter import ConvStep
from kernels.triton_utils import check_device, next_pow2

L2NORM_EPS = 1e-6
"""fla's ``l2norm_fwd`` default, which ``chunk_kda`` applies to q and k (kernels/kda/fla_adapter.py)."""


@triton.jit
def _conv_planes_kernel(
    X,  # [T, C] pre-conv q | k | v (unit stride on C)
    Y,  # [G, T, P] planes
    STATE,  # [slots, C, S] windows, oldest first (read only)
    W,  # [C, KW]
    SLOTS,  # [N] int32
    INIT,  # [N] int32 has_initial_state
    CU,  # [N + 1] int64 row offsets
    CHUNKS,  # [NT, 2] int64 (sequence, 64-token tile within it)
    P,
    stride_x_t,
    stride_y_plane,
    stride_st_n,
    stride_st_c,
    stride_w_c,
    eps,
    NORM_PLANES: tl.constexpr,
    KW: tl.constexpr,
    ROWS: tl.constexpr,  # rows of one chunk-table entry (fla's 64)
    BT: tl.constexpr,  # rows a sub-tile (>= KW - 1: the window is read by the first)
    BC: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_t = tl.program_id(1)
    i_n = tl.load(CHUNKS + i_t * 2)
    i_j = tl.load(CHUNKS + i_t * 2 + 1)
    bos = tl.load(CU + i_n)
    eos = tl.load(CU + i_n + 1)
    slot = tl.load(SLOTS + i_n).to(tl.int64)
    init = tl.load(INIT + i_n)
    o_c = i_c * BC + tl.arange(0, BC)  # BC divides P: a block is one head of one plane
    plane = (i_c * BC) // P
    # the chunk's rows in sub-tiles of BT: a [64, 128] tile held 255 registers a thread (ptxas, sm_90) and ran
    # at a third of copy bandwidth. Masks vary along tokens only: one that varied along channels would cost
    # the loads their vectors.
    for t0 in range(0, ROWS, BT):
        o_t = i_j * ROWS + t0 + tl.arange(0, BT)  # token index within the sequence
        m_t = bos + o_t < eos
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(KW):  # tap j of token t reads x[t - (KW-1) + j]
            src = o_t - (KW - 1) + j
            w = tl.load(W + o_c * stride_w_c + j).to(tl.float32)
            m_x = (m_t & (src >= 0))[:, None]
            x = tl.load(X + (bos + src)[:, None] * stride_x_t + o_c[None, :], mask=m_x, other=0.0).to(tl.float32)
            acc += x * w[None, :]
        if i_j == 0 and t0 == 0 and init != 0:  # only a sequence's first rows read its window (column KW-1 + src)
            for j in tl.static_range(KW - 1):
                src = o_t - (KW - 1) + j
                w = tl.load(W + o_c * stride_w_c + j).to(tl.float32)
                p_s = STATE + slot * stride_st_n + o_c[None, :].to(tl.int64) * stride_st_c + (KW - 1 + src)[:, None]
                s = tl.load(p_s, mask=(m_t & (src < 0))[:, None], other=0.0).to(tl.float32)
                acc += s * w[None, :]
        y = acc * tl.sigmoid(acc)
        if plane < NORM_PLANES:
            y = y.to(Y.dtype.element_ty).to(tl.float32)  # the norm reads the rounded conv output, as a separate pass
            y = y * (1 / tl.sqrt(tl.sum(y * y, 1) + eps))[:, None]
        p_y = (
            Y + plane.to(tl.int64) * stride_y_plane + (bos + o_t)[:, None].to(tl.int64) * P + (o_c - plane * P)[None, :]
        )
        tl.store(p_y, y.to(Y.dtype.element_ty), mask=m_t[:, None])


def conv_planes(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    step: ConvStep,
    planes: int = 3,
    head_dim: int = 128,
    norm_planes: int = 2,
    eps: float = L2NORM_EPS,
    num_warps: int = 2,
    block_t: int = 8,
) -> tuple[torch.Tensor, ...]:
    """SiLU(causal depthwise conv) of a varlen batch as ``planes`` contiguous [T, C/planes] tensors, the
    first ``norm_planes`` of them L2-normalised per ``head_dim`` channels. Reads each sequence's window from
    ``conv_state[slot]`` (zeros where ``has_init`` is 0) and does **not** update it (``write_windows``).

    x [T, C] (unit stride on C; a column view is fine), weight [C, W], conv_state [slots, C, S >= W-1],
    ``step``: the step's ``conv_step`` (slots, has_init, fla's 64-token chunk table)."""
    check_device("conv_planes", x, weight, conv_state)
    if x.ndim != 2 or x.stride(1) != 1 or weight.ndim != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"x [T, C] with a unit stride on C and weight [C, W]; got {x.shape}, {weight.shape}")
    t, c = x.shape
    kw = weight.shape[1]
    if conv_state.ndim != 3 or conv_state.shape[1] != c or conv_state.shape[2] < kw - 1 or conv_state.stride(2) != 1:
        raise ValueError(f"conv_state must be [slots, {c}, >= {kw - 1}], unit last stride; got {conv_state.shape}")
    if block_t != next_pow2(block_t) or not kw - 1 <= block_t <= CHUNK:
        raise ValueError(f"block_t must be a power of two in [{kw - 1}, {CHUNK}], got {block_t}")
    if head_dim != next_pow2(head_dim):
        raise ValueError(f"head_dim must be a power of two (one program's channel block), got {head_dim}")
    if planes < 1 or c % planes or (c // planes) % head_dim or not 0 <= norm_planes <= planes:
        raise ValueError(f"{planes} planes of whole {head_dim}-channel heads ({norm_planes} normed) from {c} channels")
    p = c // planes
    y = x.new_empty(planes, t, p)
    nt = step.chunk_indices.shape[0]
    if t == 0 or nt == 0:
        return tuple(y)
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    _conv_planes_kernel[(c // head_dim, nt)](
        x,
        y,
        conv_state,
        weight,
        step.slots,
        step.has_init,
        step.cu,
        step.chunk_indices,
        p,
        x.stride(0),
        y.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        weight.stride(0),
        eps,
        NORM_PLANES=norm_planes,
        KW=kw,
        ROWS=CHUNK,
        BT=block_t,
        BC=head_dim,
        num_warps=num_warps,
    )
    return tuple(y)


__all__ = ["L2NORM_EPS", "conv_planes"]
