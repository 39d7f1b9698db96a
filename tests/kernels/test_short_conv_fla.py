"""kernels/short_conv/fla_adapter.py: long prefill chunks through fla's causal_conv1d, windows by the slot
kernel's state launch. On the host fla's kernel cannot run (its autotuner needs a Triton driver, also under
the interpreter), so ``conv1d`` is ``launch_fla_conv``'s contract written in torch here (one plane,
initial_state [N, D, W], the window in columns 1..W-1); the tile table is checked against fla's own
``prepare_chunk_indices``. On CUDA the real fla kernel runs through ``launch_fla_conv``;
bench/gpu_kernels_check.py (short_conv section) checks it at real shapes."""

from __future__ import annotations

import pytest
import torch

from kernels.short_conv.fla_adapter import FLA_TILE, conv_step, launch_fla_conv, short_conv_prefill_fla
from kernels.short_conv.naive import naive_short_conv
from tests.kernels.helpers import DEVICE, ON_CUDA, assert_close, needs_cuda, tol


def _fla_contract(x, weight, initial_state, step):
    """launch_fla_conv's contract: one plane, fla's window layout [N, D, W] (columns 1..W-1), contiguous."""
    assert weight.is_contiguous() and (initial_state is None or initial_state.is_contiguous())
    ys = []
    for i in range(step.cu_cpu.numel() - 1):
        a, b = int(step.cu_cpu[i]), int(step.cu_cpu[i + 1])
        win = initial_state[i, :, 1:] if initial_state is not None else None
        ys.append(naive_short_conv(x[a:b], weight, win)[0])
    return torch.cat(ys)


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


@needs_cuda
@pytest.mark.parametrize("init", [False, True], ids=["first-chunks", "windows"])
def test_launch_is_flas_causal_conv1d(init, fla_unblocked):
    """launch_fla_conv (fla's kernel without its wrappers) gives fla's public causal_conv1d bit for bit, on a
    column view of a wider x (Kimi's q of q|k|v) in bf16."""
    from fla.modules.causal_conv1d import causal_conv1d

    g = torch.Generator().manual_seed(3)
    qsl, d, w = [0, 8192, 8192 + 300], 4096, 4
    wide = torch.randn(qsl[-1], 3 * d, generator=g).to(DEVICE, torch.bfloat16)
    x = wide[:, d : 2 * d]
    weight = torch.randn(d, w, generator=g).to(DEVICE, torch.bfloat16)
    state = torch.randn(2, d, w, generator=g).to(DEVICE, torch.bfloat16) if init else None
    step = conv_step([0, 1], qsl, [init, init], DEVICE)
    out = launch_fla_conv(x, weight, state, step)
    ref, _ = causal_conv1d(x[None], weight, initial_state=state, activation="silu", cu_seqlens=step.cu)
    assert torch.equal(out, ref[0])
