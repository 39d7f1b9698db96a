"""fla-core KDA through kernels/kda/fla_adapter.py vs kernels/kda/naive.py.

``fused_recurrent_kda_fwd`` (not public fla API) runs under the interpreter: these tests pin its slot contract
(1-D decode indices; 2-D spec indices with ``num_accepted_tokens``). ``chunk_kda`` fails under the interpreter
(InterpreterError in its state kernel), so its tests need CUDA.
"""

from __future__ import annotations

import pytest
import torch

from kernels.kda.fla_adapter import chunk_kda_varlen, fla_available, fused_recurrent_kda_slots
from kernels.kda.naive import kda_gate, naive_recurrent_kda
from tests.kernels.helpers import DEVICE, assert_close, needs_cuda

pytestmark = pytest.mark.usefixtures("fla_unblocked")


def _inputs(t, h, k, v, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, kk = (torch.randn(t, h, k, generator=g) for _ in range(2))
    vv = torch.randn(t, h, v, generator=g)
    a_log = torch.log(torch.empty(h).uniform_(1, 16, generator=g))
    dt_bias = torch.randn(h * k, generator=g) * 0.5
    gate = kda_gate(torch.randn(t, h * k, generator=g), a_log, dt_bias, k)
    beta = torch.rand(t, h, generator=g)
    return [x.to(DEVICE, dtype) for x in (q, kk, vv)] + [gate.to(DEVICE), beta.to(DEVICE, dtype)]


def _ref_step(q, k, v, g, beta, rows, state):
    """Naive KDA over rows (a slice) from state [H, K, V]; returns (o [n, H, V], final state)."""
    o, s = naive_recurrent_kda(*(x[None, rows] for x in (q, k, v, g, beta)), state[None])
    return o[0], s[0]


def test_fla_is_importable_here():
    assert fla_available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("h", "k", "v"), [(2, 32, 32), (4, 16, 32)])
def test_decode_1d_slots(h, k, v, dtype):
    n, num_slots = 3, 7
    q, kk, vv, g, beta = _inputs(n, h, k, v, dtype)
    pool = torch.randn(num_slots, h, k, v, device=DEVICE) * 0.1
    slots = torch.tensor([4, 0, 6], device=DEVICE)
    ref_pool, ref_o = pool.clone(), []
    for i in range(n):
        o, s = _ref_step(q, kk, vv, g, beta, slice(i, i + 1), ref_pool[slots[i]])
        ref_o.append(o)
        ref_pool[slots[i]] = s
    out = fused_recurrent_kda_slots(q, kk, vv, g, beta, pool, slots)
    ratio = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close("o", torch.cat(ref_o), out, ratio)
    assert_close("state", ref_pool, pool, ratio)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_spec_2d_slots(varlen):
    """Read slot idx[n, acc-1]; write the state after token t to idx[n, t]; length-0 sequences are padding."""
    h, k, v, width = 2, 32, 32, 3
    lens = [3, 2, 0, 1] if varlen else [3, 3, 3]
    n = len(lens)
    idx = torch.arange(1, 1 + n * width, device=DEVICE).view(n, width)  # slot 0 never touched
    acc = torch.tensor([2, 1, 3, 1][:n], device=DEVICE)
    cu = [0]
    for ln in lens:
        cu.append(cu[-1] + ln)
    q, kk, vv, g, beta = _inputs(cu[-1], h, k, v, seed=1)
    pool = torch.randn(1 + n * width, h, k, v, device=DEVICE) * 0.1
    ref_pool, ref_o = pool.clone(), torch.zeros(cu[-1], h, v, device=DEVICE)
    for i in range(n):
        if lens[i] == 0:
            continue
        state = ref_pool[idx[i, acc[i] - 1]].clone()
        for t in range(lens[i]):
            row = cu[i] + t
            o, state = _ref_step(q, kk, vv, g, beta, slice(row, row + 1), state)
            ref_o[row] = o[0]
            ref_pool[idx[i, t]] = state
    cu_t = torch.tensor(cu, device=DEVICE) if varlen else None
    out = fused_recurrent_kda_slots(q, kk, vv, g, beta, pool, idx, acc, cu_seqlens=cu_t)
    assert_close("o", ref_o, out, 1e-5)
    assert_close("pool", ref_pool, pool, 1e-5)


def test_spec_then_accept_equals_sequential():
    """Verify 3 tokens, the target accepts 2; the next step reads column 1 (rollback is free) and matches
    decoding the 2 accepted tokens and the next one sequentially."""
    h, k, v = 2, 16, 16
    q, kk, vv, g, beta = _inputs(4, h, k, v, seed=2)
    s0 = torch.randn(h, k, v, device=DEVICE) * 0.1
    pool = torch.zeros(4, h, k, v, device=DEVICE)
    pool[0] = s0
    idx = torch.tensor([[0, 1, 2]], device=DEVICE)
    one, two = torch.tensor([1], device=DEVICE), torch.tensor([2], device=DEVICE)
    fused_recurrent_kda_slots(q[:3], kk[:3], vv[:3], g[:3], beta[:3], pool, idx, one)  # drafts t0 t1 t2
    cu = torch.tensor([0, 1], device=DEVICE)
    out = fused_recurrent_kda_slots(q[3:], kk[3:], vv[3:], g[3:], beta[3:], pool, idx, two, cu_seqlens=cu)
    seq = [torch.cat([x[:2], x[3:]]) for x in (q, kk, vv, g, beta)]  # t0 t1 (accepted), then t3
    ref_o, ref_s = naive_recurrent_kda(*(x[None] for x in seq), s0[None])
    assert_close("o", ref_o[0, 2:], out, 1e-5)
    assert_close("state", ref_s[0], pool[0], 1e-5)


def test_adapter_validates():
    q, kk, vv, g, beta = _inputs(2, 2, 16, 16)
    pool = torch.zeros(3, 2, 16, 16, device=DEVICE)
    with pytest.raises(ValueError, match="one token per sequence"):
        fused_recurrent_kda_slots(q, kk, vv, g, beta, pool, torch.tensor([0], device=DEVICE))
    with pytest.raises(ValueError, match="state_pool"):
        fused_recurrent_kda_slots(q, kk, vv, g, beta, pool[:, :1], torch.tensor([0, 1], device=DEVICE))
    with pytest.raises(ValueError, match="fp32"):
        chunk_kda_varlen(q, kk, vv, g, beta, pool[:1].bfloat16(), [0, 2])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lens", [[100], [1, 64, 130, 7]], ids=["one", "varlen"])
def test_chunk_kda_varlen(lens, dtype):
    h, k, v = 4, 64, 64
    cu = [0]
    for ln in lens:
        cu.append(cu[-1] + ln)
    q, kk, vv, g, beta = _inputs(cu[-1], h, k, v, dtype, seed=3)
    init = torch.randn(len(lens), h, k, v, device=DEVICE) * 0.1
    o, final, states = chunk_kda_varlen(q, kk, vv, g, beta, init, cu, return_intermediate_states=True)
    ratio = 5e-3 if dtype == torch.float32 else 2e-2  # fla's chunk kernels use TF32 dots in fp32
    chunk = 0
    for i, ln in enumerate(lens):
        rows = slice(cu[i], cu[i + 1])
        ref_o, ref_s = _ref_step(q, kk, vv, g, beta, rows, init[i])
        assert_close(f"o[{i}]", ref_o, o[rows], ratio)
        assert_close(f"state[{i}]", ref_s, final[i], ratio)
        for c in range(-(-ln // 64)):  # states[chunk] = state entering the chunk: after 64*c tokens
            if c == 0:
                ref_c = init[i]
            else:
                _, ref_c = _ref_step(q, kk, vv, g, beta, slice(cu[i], cu[i] + 64 * c), init[i])
            assert_close(f"h[{i},{c}]", ref_c, states[chunk].float(), 2e-2)
            chunk += 1
    assert chunk == states.shape[0]
