"""Reference short-conv state update with slot indices and speculative verify (accepted-token shift).

The plain contract (kernels/short_conv/naive.py) keeps the last W-1 pre-conv inputs, oldest first. With
speculative decoding a verify step feeds ``1 + num_spec`` tokens whose tail may be rejected, so the slot keeps
a wider state of ``S = W-1+num_spec`` columns and the *next* step picks the committed window by the
number of tokens accepted:

    state (per slot) [C, S], S >= W-1.  a = num_accepted (>= 1; 1 when there was nothing to verify)
    window   = state[:, a-1 : a-1+W-1]            # the last W-1 committed inputs, oldest first
    y        = silu(causal depthwise conv of (window | x))          (exactly as naive_short_conv)

    plain write (prefill chunks, ordinary decode):
        state[:, :W-1] = last W-1 columns of (window | x)          # a = 1 and S = W-1 gives naive_short_conv
    spec write (a verify step of L <= S-(W-2) tokens x_1..x_L, num_spec = S-(W-1)):
        state[:, :W-2]       = window[:, 1:]                       # the W-2 committed inputs before x_1
        state[:, W-2 : W-2+L] = x^T                                # x_j at column W-3+j (j = 1..L)
        (columns W-2+L .. S-1 unchanged)

So after a spec step with L tokens of which the next step reports ``a`` accepted, columns a-1 .. a+W-3 hold
the W-1 inputs ending at x_a: the next step's window, whatever L was. Rejected columns are never read, so
rollback costs nothing (vLLM's GDN path rolls its conv state the same way). A window written by a spec step
must be read with its ``num_accepted`` (or moved to column 0 with kernels/state_copy's ``conv_shift``).
With ``has_initial_state`` False the window is zeros (a request's first chunk).
"""

from __future__ import annotations

import torch

from kernels.short_conv.naive import naive_short_conv


def naive_short_conv_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor,
    num_accepted: int = 1,
    has_initial_state: bool = True,
    spec: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [L, C]; weight [C, W]; state [C, S]. Returns (silu(conv) [L, C], new state [C, S]); ``state`` untouched."""
    c, w = weight.shape
    s = state.shape[-1]
    if not 1 <= num_accepted <= s - (w - 1) + 1:
        raise ValueError(f"num_accepted {num_accepted} must be in [1, {s - w + 2}] for a state of width {s}")
    off = num_accepted - 1
    window = state[:, off : off + w - 1] if has_initial_state else None
    y, last = naive_short_conv(x, weight, window)
    new = state.clone()
    if not spec:
        new[:, : w - 1] = last.to(state.dtype)
        return y, new
    if x.shape[0] > s - (w - 2):
        raise ValueError(f"a spec step of {x.shape[0]} tokens does not fit a state of width {s} (W={w})")
    prev = window if window is not None else state.new_zeros(c, w - 1)
    new[:, : w - 2] = prev[:, 1:]
    new[:, w - 2 : w - 2 + x.shape[0]] = x.t().to(state.dtype)
    return y, new
