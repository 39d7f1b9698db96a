"""The MoE gate-up GEMM of ``kernels/moe/prefill.py`` with the expert weights read through TMA.
Contract: ``prefill.gate_up_fused`` (silu(x[token] @ w1[e]^T) * (x[token] @ w3[e]^T) per sorted row).

Why: compiled for sm_90, the pointer kernel feeds Hopper's wgmma with ``cp.async`` for both operands and holds
255 registers a thread at its 128 x 128 x 64 tile, 8 warps, 4 stages (192 KB of shared memory: one block an
SM); the address arithmetic and the copies are issued by the same warps that run the MMAs. Here the weight
tiles (two thirds of the operand bytes) come through tensor descriptors — the copy engine writes them to
shared memory in the MMA's layout (Triton's ``warp_specialize`` of the loop is not used: a no-op for sm_90 in
Triton 3.9, an assertion in Triton 3.6's warp-specialization pass on the lent H200). The activation rows stay
a pointer gather (rows by token: a TMA gather is Blackwell's). On the H200 (``python -m
bench.moe_gate_up_tma``, seventeenth session) it took 1.18 ms against the pointer kernel's 1.32 at 8k tokens
and 4.06 against 4.46 at 32k, outputs identical: the engine's prefill MoE runs it where ``tma_usable``
(``moe_experts_prefill(gate_up_impl="auto")``).

The down GEMM (``down_tma``) takes both operands through descriptors: its rows are already in sorted order, so
the activation tile is a plain box too. On the H200 (``python -m bench.moe_down_tma``) it beat torch's
grouped_mm below 16k tokens (0.622 vs 0.652 ms at 8k) and lost slightly at 32k (2.02 vs 2.00): the engine runs
it below ``prefill.TMA_LONG_PAIRS`` pairs (``TANDEM_MOE_DOWN_IMPL`` overrides).

Weight tiles past a gate / up block's last column read the next rows of the [E*2I, H] view (or zeros past its
end: TMA pads out-of-bounds boxes with zeros); those output columns are masked at the store, as in the
pointer kernel. The same holds along H.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.moe.grouped import MoEAlign
from kernels.moe.tiles import GemmTiles, TileMap, fitted, tile_slot, tiles_of
from kernels.triton_utils import dot_config, mm


@triton.jit
def _gate_up_tma_kernel(
    X,  # [T, H] activations
    TOKEN,  # [N] int64 token of each sorted row
    ENDS,  # [E] int32
    TILE_E,
    TILE_ROW,
    W_DESC,  # descriptor over W13 viewed [E * 2I, H], boxes [BLOCK_N, BLOCK_K]
    A,  # [N, I] out: silu(gate) * up, sorted rows
    H,
    INTER,
    num_n,
    stride_x,
    stride_a,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    e, row0, end, n0 = tile_slot(TILE_E, TILE_ROW, ENDS, num_n, BLOCK_N)
    if e < 0:
        return
    o_m = row0 + tl.arange(0, BLOCK_M)
    m_m = o_m < end
    tok = tl.load(TOKEN + o_m, mask=m_m, other=0)
    o_n = n0 + tl.arange(0, BLOCK_N)
    g_row = e * 2 * INTER + n0
    o_k = tl.arange(0, BLOCK_K)
    p_x = X + tok[:, None] * stride_x + o_k[None, :]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            x = tl.load(p_x + k0, mask=m_m[:, None], other=0.0)
        else:
            x = tl.load(p_x + k0, mask=m_m[:, None] & ((k0 + o_k) < H)[None, :], other=0.0)
        g = W_DESC.load([g_row, k0])  # [BLOCK_N, BLOCK_K], K contiguous
        u = W_DESC.load([g_row + INTER, k0])
        acc_g += mm(x, g.T, DOT_F32, PREC)
        acc_u += mm(x, u.T, DOT_F32, PREC)
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    p_a = A + o_m[:, None].to(tl.int64) * stride_a + o_n[None, :]
    tl.store(p_a, act.to(A.dtype.element_ty), mask=m_m[:, None] & (o_n < INTER)[None, :])


@triton.jit
def _down_tma_kernel(
    A_DESC,  # descriptor over a [N, I] (sorted rows), boxes [BLOCK_M, BLOCK_K]
    ENDS,  # [E] int32
    TILE_E,
    TILE_ROW,
    W_DESC,  # descriptor over w2 viewed [E * H, I], boxes [BLOCK_N, BLOCK_K]
    Y,  # [N, H] out, sorted rows
    H,
    INTER,
    num_n,  # column blocks of H
    stride_y,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # both operands by TMA: a tile's rows are contiguous in the sorted layout (no gather). Rows past the
    # expert's end (the next expert's, or zeros past N), weight rows past H (the next expert's) and the
    # reduction past I (zeros) only reach masked output cells or add zero products.
    e, row0, end, n0 = tile_slot(TILE_E, TILE_ROW, ENDS, num_n, BLOCK_N)
    if e < 0:
        return
    o_m = row0 + tl.arange(0, BLOCK_M)
    o_n = n0 + tl.arange(0, BLOCK_N)
    w_row = e * H + n0
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, INTER, BLOCK_K, num_stages=NUM_STAGES):
        a = A_DESC.load([row0, k0])  # [BLOCK_M, BLOCK_K]
        w = W_DESC.load([w_row, k0])  # [BLOCK_N, BLOCK_K], K contiguous
        acc += mm(a, w.T, DOT_F32, PREC)
    p_y = Y + o_m[:, None].to(tl.int64) * stride_y + o_n[None, :]
    tl.store(p_y, acc.to(Y.dtype.element_ty), mask=(o_m < end)[:, None] & (o_n < H)[None, :])


def tma_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the TMA kernels can run on activations ``x`` and expert weights ``w`` here and were measured to
    win: Hopper or newer (TMA), 16-bit operands (the fp32 tiles were never timed through them), a contiguous
    ``w`` with 16-byte rows (its last axis is the reduction)."""
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and w.dtype == x.dtype):
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return (
        torch.cuda.get_device_capability(index) >= (9, 0)
        and w.is_contiguous()
        and (w.shape[-1] * w.element_size()) % 16 == 0
    )


def gate_up_tma(
    x: torch.Tensor,
    al: MoEAlign,
    w13: torch.Tensor,
    tiles: GemmTiles,
    tmap: TileMap | None = None,
) -> torch.Tensor:
    """``prefill.gate_up_fused`` with the weights through TMA: [N, I] in x's dtype. w13 [E, 2I, H] contiguous."""
    e, i2, h = w13.shape
    i = i2 // 2
    n = al.token.numel()
    a = torch.empty(n, i, dtype=x.dtype, device=x.device)
    if n == 0:
        return a
    if not w13.is_contiguous() or x.stride(1) != 1:
        raise ValueError("gate_up_tma: w13 must be contiguous and x contiguous along H")
    if (h * w13.element_size()) % 16:
        raise ValueError(f"gate_up_tma: TMA needs 16-byte rows, H={h} of {w13.dtype} is not")
    dot_f32, prec = dot_config(x.dtype)
    tiles = fitted(tiles, 2, x)
    tm = tiles_of(al, n, tiles.block_m, tmap)
    num_n = triton.cdiv(i, tiles.block_n)
    desc = TensorDescriptor.from_tensor(w13.view(e * i2, h), [tiles.block_n, tiles.block_k])
    _gate_up_tma_kernel[(tm.tile_e.numel() * num_n,)](
        x, al.token, tm.ends, tm.tile_e, tm.tile_row, desc, a, h, i, num_n, x.stride(0), a.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, EVEN_K=h % tiles.block_k == 0,
        DOT_F32=dot_f32, PREC=prec, NUM_STAGES=tiles.num_stages,
        num_warps=tiles.num_warps,
    )  # fmt: skip
    return a


def down_tma(
    a: torch.Tensor, al: MoEAlign, w2: torch.Tensor, tiles: GemmTiles, tmap: TileMap | None = None
) -> torch.Tensor:
    """``prefill.down_grouped`` with both operands through TMA: a [N, I] sorted rows -> [N, H] in a's dtype.
    w2 [E, H, I] and a contiguous, I * itemsize a multiple of 16 bytes (TMA's row alignment)."""
    e, h, i = w2.shape
    n = a.shape[0]
    y = torch.empty(n, h, dtype=a.dtype, device=a.device)
    if n == 0:
        return y
    if not (w2.is_contiguous() and a.is_contiguous()):
        raise ValueError("down_tma: w2 and a must be contiguous")
    if (i * w2.element_size()) % 16:
        raise ValueError(f"down_tma: TMA needs 16-byte rows, I={i} of {w2.dtype} is not")
    dot_f32, prec = dot_config(a.dtype)
    tiles = fitted(tiles, 1, a)
    tm = tiles_of(al, n, tiles.block_m, tmap)
    num_n = triton.cdiv(h, tiles.block_n)
    a_desc = TensorDescriptor.from_tensor(a, [tiles.block_m, tiles.block_k])
    w_desc = TensorDescriptor.from_tensor(w2.view(e * h, i), [tiles.block_n, tiles.block_k])
    _down_tma_kernel[(tm.tile_e.numel() * num_n,)](
        a_desc, tm.ends, tm.tile_e, tm.tile_row, w_desc, y, h, i, num_n, y.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, DOT_F32=dot_f32, PREC=prec,
        NUM_STAGES=tiles.num_stages, num_warps=tiles.num_warps,
    )  # fmt: skip
    return y


__all__ = ["down_tma", "gate_up_tma", "tma_usable"]
