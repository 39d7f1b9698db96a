"""One program of the slot-indexed short conv: the body ``_short_conv_kernel`` (kernels/short_conv/triton.py) runs
at its own program ids, and kernels/short_conv/in_proj_conv.py after in_proj's GEMV programs in one launch.
Contracts and layout: kernels/short_conv/triton.py's docstring."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.short_conv.low_rank import low_rank_up_block


@triton.jit
def short_conv_program(
    X,  # [T, C]
    Y,  # [T, C], or [G, T, C/G] planes (PLANE_C channels each)
    STATE,  # [slots, C, S]
    W,  # [C, KW]
    SLOTS,  # [N] int32 (-1: padding, skipped)
    QSL,  # [N + 1] int32
    ACC,  # [N] int32 num_accepted (if HAS_ACC)
    INIT,  # [N] int32 has_initial_state
    C,
    S,
    stride_x_t,
    stride_y_t,
    stride_y_plane,
    PLANE_C,
    stride_st_n,
    stride_st_c,
    stride_w_c,
    T_CHUNK,
    N_CHUNKS,
    LR_A,  # KDA's up-projections (LOW_RANK): kernels/short_conv/low_rank.py
    LR_B,
    LR_OUT,
    LR_T,
    LR_P,
    LR_K,
    LR_BLOCKS,
    stride_lr_a_t,
    stride_lr_a_j,
    stride_lr_b_j,
    stride_lr_b_c,
    KW: tl.constexpr,
    SPEC: tl.constexpr,
    HAS_ACC: tl.constexpr,
    CONV: tl.constexpr,
    WRITE_STATE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    LOW_RANK: tl.constexpr,
    LR_BLOCK_C: tl.constexpr,
    LR_BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREC: tl.constexpr,
    i_n,
    i_c,
    i_t,
    n_rows,  # programs on axis 0: the sequences, then the up-projections' row
    X_CACHE: tl.constexpr,  # X's (and the up-projections' A's) load cache modifier
):
    """One program of the short conv: sequence i_n's channel block i_c, token chunk i_t (or, with LOW_RANK, the
    up-projections' block i_c in the last row). X_CACHE: ".cg" where other programs of the same launch wrote X
    (kernels/short_conv/in_proj_conv.py)."""
    if LOW_RANK:  # the last row of programs runs the up-projections; the conv's columns may be fewer
        lr_row = i_n == n_rows - 1
    else:
        lr_row = False
    if lr_row:
        if (i_c < LR_BLOCKS) & (i_t == 0):
            low_rank_up_block(
                LR_A, LR_B, LR_OUT, i_c, LR_T, LR_P, LR_K, stride_lr_a_t, stride_lr_a_j, stride_lr_b_j,
                stride_lr_b_c, LR_BLOCK_C, LR_BLOCK_K, DOT_F32, PREC, X_CACHE,
            )  # fmt: skip
    elif i_c * BLOCK_C < C:
        slot = tl.load(SLOTS + i_n).to(tl.int64)
        if slot >= 0:
            _conv_channels(
                X, Y, STATE, W, QSL, ACC, INIT, C, stride_x_t, stride_y_t, stride_y_plane, PLANE_C, stride_st_n,
                stride_st_c, stride_w_c, T_CHUNK, N_CHUNKS, i_n, i_c, i_t, slot, KW, SPEC, HAS_ACC, CONV,
                WRITE_STATE, BLOCK_C, BLOCK_T, BLOCK_S, X_CACHE,
            )  # fmt: skip


@triton.jit
def _conv_channels(
    X, Y, STATE, W, QSL, ACC, INIT, C, stride_x_t, stride_y_t, stride_y_plane, PLANE_C, stride_st_n, stride_st_c,
    stride_w_c, T_CHUNK, N_CHUNKS, i_n, i_c, i_t, slot,
    KW: tl.constexpr, SPEC: tl.constexpr, HAS_ACC: tl.constexpr, CONV: tl.constexpr, WRITE_STATE: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, X_CACHE: tl.constexpr,
):  # fmt: skip
    """Sequence i_n's channel block i_c, token chunk i_t: the conv + SiLU, then (WRITE_STATE) its new window."""
    bos = tl.load(QSL + i_n)
    seq_len = tl.load(QSL + i_n + 1) - bos
    init = tl.load(INIT + i_n)
    if HAS_ACC:
        off = tl.load(ACC + i_n) - 1
    else:
        off = 0
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < C
    m_ci = m_c & ((o_c * 0 + init) != 0)  # channels whose old window is read (zeros on a first chunk)
    p_st = STATE + slot * stride_st_n + o_c.to(tl.int64) * stride_st_c  # [BLOCK_C] row starts of this slot
    p_x = X + bos.to(tl.int64) * stride_x_t + o_c[None, :]
    o_y = (o_c // PLANE_C).to(tl.int64) * stride_y_plane + o_c % PLANE_C  # channel -> (plane, column)
    p_y = Y + bos.to(tl.int64) * stride_y_t + o_y[None, :]

    if CONV:
        t_end = tl.minimum(seq_len, (i_t + 1) * T_CHUNK)
        t_end = tl.where(i_t == N_CHUNKS - 1, seq_len, t_end)
        for t0 in range(i_t * T_CHUNK, t_end, BLOCK_T):
            o_t = t0 + tl.arange(0, BLOCK_T)
            m_t = o_t < t_end
            b_acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
            for j in tl.static_range(KW):
                # input feeding tap j of token t: x[t - (KW-1) + j], or window column off + j + t for t - (KW-1) + j < 0
                o_src = o_t - (KW - 1) + j
                b_w = tl.load(W + o_c * stride_w_c + j, mask=m_c, other=0.0).to(tl.float32)
                m_x = (m_t & (o_src >= 0))[:, None] & m_c[None, :]
                b_x = tl.load(p_x + o_src[:, None].to(tl.int64) * stride_x_t, mask=m_x, other=0.0,
                              cache_modifier=X_CACHE).to(tl.float32)  # fmt: skip
                m_s = (m_t & (o_src < 0))[:, None] & m_ci[None, :]
                b_s = tl.load(p_st[None, :] + (off + KW - 1 + o_src)[:, None], mask=m_s, other=0.0).to(tl.float32)
                b_acc += (b_x + b_s) * b_w[None, :]
            b_y = b_acc * tl.sigmoid(b_acc)
            m_y = m_t[:, None] & m_c[None, :]
            tl.store(p_y + o_t[:, None].to(tl.int64) * stride_y_t, b_y.to(Y.dtype.element_ty), mask=m_y)

    if WRITE_STATE:
        _write_window(X, STATE, p_st, o_c, m_c, m_ci, bos, seq_len, off, stride_x_t, KW, SPEC, BLOCK_S, X_CACHE)


@triton.jit
def _write_window(
    X, STATE, p_st, o_c, m_c, m_ci, bos, seq_len, off, stride_x_t,
    KW: tl.constexpr, SPEC: tl.constexpr, BLOCK_S: tl.constexpr, X_CACHE: tl.constexpr,
):  # fmt: skip
    # the new state, column by column: from the old state (below the split) or from x
    o_s = tl.arange(0, BLOCK_S)
    if SPEC:
        n_cols = KW - 2 + seq_len
        m_old = o_s < KW - 2
        o_old = off + 1 + o_s
        o_xi = o_s - (KW - 2)
    else:
        n_cols = KW - 1
        o_xi = seq_len - (KW - 1) + o_s
        m_old = o_xi < 0
        o_old = off + KW - 1 + o_xi
    m_w = (o_s < n_cols)[None, :] & m_c[:, None]
    b_old = tl.load(p_st[:, None] + o_old[None, :], mask=m_w & m_old[None, :] & m_ci[:, None], other=0.0)
    p_xs = X + (bos + o_xi).to(tl.int64)[None, :] * stride_x_t + o_c[:, None]
    b_new = tl.load(p_xs, mask=m_w & (~m_old)[None, :], other=0.0, cache_modifier=X_CACHE)
    b_new = b_new.to(STATE.dtype.element_ty)
    b_new = tl.where(m_old[None, :], b_old, b_new)
    tl.debug_barrier()  # all reads of this slot (above) happen before any write
    tl.store(p_st[:, None] + o_s[None, :], b_new, mask=m_w)


__all__ = ["short_conv_program"]
