"""Triton slot-indexed short conv vs kernels/short_conv/naive.py (plain) and naive_spec.py (spec verify)."""

from __future__ import annotations

import pytest
import torch

from kernels.short_conv.naive import naive_short_conv
from kernels.short_conv.naive_spec import naive_short_conv_update
from kernels.short_conv.triton import ConvTiles, short_conv_update
from tests.kernels.helpers import DEVICE, assert_close, tol


def _inputs(lens, c, w, num_slots, width, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    x = torch.randn(qsl[-1], c, generator=g).to(DEVICE, dtype)
    weight = torch.randn(c, w, generator=g).to(DEVICE, dtype)
    state = torch.randn(num_slots, c, width, generator=g).to(DEVICE, dtype)
    return qsl, x, weight, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("lens", "init"),
    [
        ([1, 1, 1], [True, True, True]),  # decode
        ([1, 2, 37], [False, True, True]),  # first chunk, shorter-than-window chunk, long chunk
        ([5, 1, 64, 3], [True, False, False, True]),
    ],
)
@pytest.mark.parametrize(("c", "w"), [(96, 4), (40, 2), (24, 3)])
def test_plain_matches_naive(c, w, lens, init, dtype):
    slots = [5, 0, 3, 2][: len(lens)]
    qsl, x, weight, state = _inputs(lens, c, w, 6, w - 1, dtype)
    ref_state, ref = state.clone(), torch.empty_like(x)
    for i, s in enumerate(slots):
        y, win = naive_short_conv(x[qsl[i] : qsl[i + 1]], weight, ref_state[s] if init[i] else None)
        ref[qsl[i] : qsl[i + 1]], ref_state[s] = y, win
    out = short_conv_update(x, weight, state, slots, qsl, init)
    assert_close("y", ref, out, tol(dtype))
    assert torch.equal(state, ref_state)  # the window is a copy of inputs: bit-exact


@pytest.mark.parametrize("qsl_kind", ["host", "device+hint", "device+small-hint", "device"])
def test_long_sequences_run_in_token_chunks(qsl_kind):
    """Sequences longer than T_CHUNK run as parallel chunks plus a state-writing launch; the chunk
    boundaries (256, 512) fall inside sequences, and a max_q_len hint that is too small loses no token."""
    lens, init, slots = [600, 3, 300], [True, False, True], [2, 0, 1]
    qsl, x, weight, state = _inputs(lens, 24, 4, 3, 3, torch.float32, seed=3)
    ref_state, ref = state.clone(), torch.empty_like(x)
    for i, s in enumerate(slots):
        y, win = naive_short_conv(x[qsl[i] : qsl[i + 1]], weight, ref_state[s] if init[i] else None)
        ref[qsl[i] : qsl[i + 1]], ref_state[s] = y, win
    if qsl_kind == "host":
        out = short_conv_update(x, weight, state, slots, qsl, init)
    else:
        hint = {"device+hint": 600, "device+small-hint": 300, "device": None}[qsl_kind]
        qsl_t = torch.tensor(qsl, dtype=torch.int32, device=DEVICE)
        slots_t = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
        out = short_conv_update(x, weight, state, slots_t, qsl_t, init, max_q_len=hint)
    assert_close("y", ref, out, tol(torch.float32))
    assert torch.equal(state, ref_state)


@pytest.mark.parametrize(
    "tiles",
    [ConvTiles(32, 16, 64, 2), ConvTiles(64, 32, 64, 4), ConvTiles(16, 64, 16, 1), ConvTiles(32, 16, 8, 2)],
    ids=["t32c16k64", "t64c32k64", "t16c64k16", "chunk-below-tile"],
)
def test_any_tiles_and_a_strided_input_match_naive(tiles):
    """Launch parameters other than the default (as bench/short_conv_sweep.py times them) and x as a column
    view of a wider projection output (the model's q|k|v slice: no contiguous copy) give the same result."""
    lens, init, slots = [150, 3, 70], [True, False, True], [2, 0, 1]
    qsl, x, weight, state = _inputs(lens, 40, 4, 3, 3, torch.float32, seed=5)
    wide = torch.randn(x.shape[0], 56, device=DEVICE)
    wide[:, 8:48] = x
    xv = wide[:, 8:48]
    assert not xv.is_contiguous()
    ref_state, ref = state.clone(), torch.empty_like(x)
    for i, s in enumerate(slots):
        y, win = naive_short_conv(x[qsl[i] : qsl[i + 1]], weight, ref_state[s] if init[i] else None)
        ref[qsl[i] : qsl[i + 1]], ref_state[s] = y, win
    out = short_conv_update(xv, weight, state, slots, qsl, init, tiles=tiles)
    assert_close("y", ref, out, tol(torch.float32))
    assert torch.equal(state, ref_state)


@pytest.mark.parametrize(("lens", "c"), [([1, 1, 1], 96), ([600, 3, 70], 48), ([5, 1, 64, 3], 24)])
def test_planes_hold_the_same_values_as_one_output(lens, c):
    """planes=3 (Kimi's q | k | v as three contiguous tensors) writes exactly the values of the [T, C] output,
    channel c in plane c // (C/3): channel blocks that straddle planes, decode, and chunked long sequences."""
    init, slots = [True, False, True, True][: len(lens)], [2, 0, 1, 3][: len(lens)]
    qsl, x, weight, state = _inputs(lens, c, 4, 4, 3, torch.float32, seed=9)
    state_planes, windows = state.clone(), state.clone()
    ref = torch.empty_like(x)  # the naive reference, independent of the one-output launch
    for i, s in enumerate(slots):
        ref[qsl[i] : qsl[i + 1]], windows[s] = naive_short_conv(
            x[qsl[i] : qsl[i + 1]], weight, windows[s] if init[i] else None
        )
    flat = short_conv_update(x, weight, state, slots, qsl, init)
    planes = short_conv_update(x, weight, state_planes, slots, qsl, init, planes=3)
    assert planes.shape == (3, x.shape[0], c // 3) and planes.is_contiguous()
    assert torch.equal(torch.cat(planes.unbind(0), dim=1), flat)
    assert torch.equal(state_planes, state)
    assert_close("planes vs naive", ref, torch.cat(planes.unbind(0), dim=1), tol(torch.float32))
    assert torch.equal(state_planes, windows)
    with pytest.raises(ValueError, match="planes must divide"):
        short_conv_update(x, weight, state, slots, qsl, init, planes=5)


def test_padding_slot_is_skipped():
    qsl, x, weight, state = _inputs([2, 3], 32, 4, 4, 3, torch.float32)
    before = state.clone()
    out = torch.full_like(x, 7.0)
    short_conv_update(x, weight, state, [-1, 1], qsl, out=out)
    assert torch.equal(out[:2], torch.full_like(x[:2], 7.0))
    assert torch.equal(state[[0, 2, 3]], before[[0, 2, 3]])
    ref, win = naive_short_conv(x[2:], weight, before[1])
    assert_close("y", ref, out[2:], tol(torch.float32))
    assert torch.equal(state[1], win)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_spec", [1, 3])
@pytest.mark.parametrize("w", [4, 2])
def test_spec_matches_naive_spec(w, num_spec, dtype):
    width = w - 1 + num_spec
    lens = [num_spec + 1, 1, num_spec + 1, max(1, num_spec)]
    accepted = [1, num_spec + 1, num_spec, 2 if num_spec > 1 else 1]
    init = [True, True, False, True]
    slots = [3, 0, 1, 4]
    qsl, x, weight, state = _inputs(lens, 48, w, 5, width, dtype, seed=1)
    ref_state, ref = state.clone(), torch.empty_like(x)
    for i, s in enumerate(slots):
        y, new = naive_short_conv_update(x[qsl[i] : qsl[i + 1]], weight, ref_state[s], accepted[i], init[i], spec=True)
        ref[qsl[i] : qsl[i + 1]], ref_state[s] = y, new
    out = short_conv_update(x, weight, state, slots, qsl, init, num_accepted=accepted, spec=True)
    assert_close("y", ref, out, tol(dtype))
    assert torch.equal(state, ref_state)


@pytest.mark.parametrize("num_accepted", [1, 2])
def test_plain_write_with_accepted_offset(num_accepted):
    """A prefill chunk after a verify step reads the window at the accepted column, then writes plainly."""
    w, width = 4, 5
    qsl, x, weight, state = _inputs([6, 2], 32, w, 3, width, torch.float32, seed=2)
    ref_state, ref = state.clone(), torch.empty_like(x)
    for i, s in enumerate([2, 0]):
        y, new = naive_short_conv_update(x[qsl[i] : qsl[i + 1]], weight, ref_state[s], num_accepted)
        ref[qsl[i] : qsl[i + 1]], ref_state[s] = y, new
    out = short_conv_update(x, weight, state, [2, 0], qsl, num_accepted=[num_accepted] * 2)
    assert_close("y", ref, out, tol(torch.float32))
    assert torch.equal(state, ref_state)


def test_naive_spec_reduces_to_plain():
    _, x, weight, state = _inputs([5], 16, 4, 1, 3, torch.float32)
    y0, win = naive_short_conv(x, weight, state[0])
    y1, new = naive_short_conv_update(x, weight, state[0])
    assert torch.equal(y0, y1) and torch.equal(win, new)


@pytest.mark.parametrize("w", [4, 3])
def test_spec_rollback_equals_sequential_decode(w):
    """Verify steps with rejected drafts give the outputs of decoding only the accepted tokens one by one."""
    num_spec, c = 3, 32
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(c, w, generator=g).to(DEVICE)
    prompt = torch.randn(9, c, generator=g).to(DEVICE)
    state = torch.zeros(1, c, w - 1 + num_spec, device=DEVICE)
    short_conv_update(prompt, weight, state, [0], [0, 9], [False])  # prefill: plain write
    window = naive_short_conv(prompt, weight, None)[1]  # sequential reference state
    accepted = 1
    for step, acc_next in enumerate([2, 4, 1, 3]):
        drafts = torch.randn(num_spec + 1, c, generator=g).to(DEVICE)
        y = short_conv_update(drafts, weight, state, [0], [0, num_spec + 1], num_accepted=[accepted], spec=True)
        for t in range(acc_next):  # the committed tokens, decoded one at a time
            y_ref, window = naive_short_conv(drafts[t : t + 1], weight, window)
            assert_close(f"step {step} token {t}", y_ref, y[t : t + 1], tol(torch.float32))
        accepted = acc_next
    assert torch.equal(state[0, :, accepted - 1 : accepted - 1 + w - 1], window)


def test_rejects_out_of_contract_inputs():
    qsl, x, weight, state = _inputs([5], 16, 4, 2, 4, torch.float32)
    with pytest.raises(ValueError, match="spec step of 5 tokens"):
        short_conv_update(x, weight, state, [0], qsl, spec=True)
    with pytest.raises(ValueError, match="num_accepted"):
        short_conv_update(x, weight, state, [0], qsl, num_accepted=[3])
    with pytest.raises(ValueError, match="query_start_loc"):
        short_conv_update(x, weight, state, [0], [0, 4])
