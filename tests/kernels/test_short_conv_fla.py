"""kernels/short_conv/fla_adapter.py: long prefill chunks through fla's causal_conv1d, windows by the slot
kernel's state launch. On the host fla's kernel cannot run (no Triton driver), so ``conv1d`` is fla's contract
written in torch here (initial_state [N, C, W], the window in columns 1..W-1); the tile table is checked
against fla's own ``prepare_chunk_indices``. On CUDA the real fla kernel runs; bench/gpu_kernels_check.py
(short_conv section) checks it at real shapes."""

from __future__ import annotations

import pytest
import torch

from kernels.short_conv.fla_adapter import FLA_TILE, conv_step, short_conv_prefill_fla
from kernels.short_conv.naive import naive_short_conv
from tests.kernels.helpers import DEVICE, ON_CUDA, assert_close, tol


def _fla_contract(x, weight, initial_state=None, activation=None, cu_seqlens=None, cu_seqlens_cpu=None, **_):
    assert activation == "silu" and x.shape[0] == 1
    ys = []
    for i in range(cu_seqlens_cpu.numel() - 1):
        a, b = int(cu_seqlens_cpu[i]), int(cu_seqlens_cpu[i + 1])
        win = initial_state[i, :, 1:] if initial_state is not None else None
        ys.append(naive_short_conv(x[0, a:b], weight, win)[0])
    return torch.cat(ys)[None], None


@pytest.mark.parametrize(
    ("lens", "init"),
    [([300, 2, 65], [True, False, True]), ([130, 64], [False, False]), ([1, 200], [True, True])],
    ids=["mixed", "first-chunks", "short-window"],
)
@pytest.mark.parametrize("planes", [1, 3])
def test_matches_naive_windows_bit_exact(lens, init, planes, fla_unblocked):
    """planes=3: one fla launch per third of the channels (q, k, v), each output contiguous."""
    g = torch.Generator().manual_seed(7)
    c, w, slots = 48, 4, [3, 0, 2][: len(lens)]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    wide = torch.randn(qsl[-1], c + 8, generator=g).to(DEVICE)
    x = wide[:, 4 : 4 + c]  # the q|k|v column view, as the model passes it
    weight = torch.randn(c, w, generator=g).to(DEVICE)
    state = torch.randn(4, c, w - 1, generator=g).to(DEVICE)
    for s, has in zip(slots, init, strict=True):
        if not has:
            state[s] = float("nan")  # a fresh slot's junk must not leak into a first chunk
    ref_state, ref = state.clone(), torch.empty(x.shape, device=DEVICE)
    for i, s in enumerate(slots):
        y, win = naive_short_conv(x[qsl[i] : qsl[i + 1]], weight, ref_state[s] if init[i] else None)
        ref[qsl[i] : qsl[i + 1]], ref_state[s] = y, win
    step = conv_step(slots, qsl, init, DEVICE)
    from fla.ops.utils.index import prepare_chunk_indices

    want = prepare_chunk_indices(torch.tensor(qsl), FLA_TILE)
    assert torch.equal(step.chunk_indices.cpu(), want)
    out = short_conv_prefill_fla(x, weight, state, step, conv1d=None if ON_CUDA else _fla_contract, planes=planes)
    if planes > 1:
        assert len(out) == planes and all(y.is_contiguous() and y.shape == (qsl[-1], c // planes) for y in out)
        out = torch.cat(out, dim=1)
    assert_close("y", ref, out, tol(torch.float32))
    untouched = [s for s in range(4) if s not in slots]
    assert torch.equal(state[slots], ref_state[slots])
    assert torch.equal(state[untouched], ref_state[untouched])


def test_refuses_padding_slots_and_bad_offsets():
    with pytest.raises(ValueError, match="real slots"):
        conv_step([0, -1], [0, 3, 5], [True, True], DEVICE)
    with pytest.raises(ValueError, match="offsets"):
        conv_step([0, 1], [0, 3], [True, True], DEVICE)
