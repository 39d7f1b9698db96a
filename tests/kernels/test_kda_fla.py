"""fla-core KDA through kernels/kda/fla_adapter.py vs kernels/kda/naive.py.

``fused_recurrent_kda_fwd`` (not public fla API) runs under the interpreter: these tests pin its slot contract
(1-D decode indices; 2-D spec indices with ``num_accepted_tokens``). kernels/kda/recurrent_launch.py launches
its kernel with our own tile: every tile must reproduce fla's wrapper. ``chunk_kda`` fails under the
interpreter (InterpreterError in its state kernel), so its tests need CUDA.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels.kda.fla_adapter import chunk_kda_varlen, chunk_layout, fla_available, fused_recurrent_kda_slots
from kernels.kda.naive import kda_gate, naive_recurrent_kda
from kernels.kda.recurrent_launch import DEFAULT_RECURRENT_TILE, RecurrentTile, launch_fused_recurrent_kda, tile_for
from tests.kernels.helpers import DEVICE, ON_CUDA, assert_close, needs_cuda

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_with_the_gate_and_beta_sigmoid_in_the_kernel(dtype):
    """gate=(A_log, dt_bias), beta_logits=True: the kernel applies kda_gate to the raw gate projection and the
    sigmoid to beta's logits as it reads them; the same o and states as gating first (the naive recurrence)."""
    n, h, k, v, num_slots = 3, 2, 32, 32, 5
    gen = torch.Generator().manual_seed(11)
    q, kk, vv = (torch.randn(n, h, d, generator=gen).to(DEVICE, dtype) for d in (k, k, v))
    g_raw = torch.randn(n, h * k, generator=gen).to(DEVICE, dtype)
    a_log = torch.log(torch.empty(h).uniform_(1, 16, generator=gen)).to(DEVICE)
    dt_bias = (torch.randn(h * k, generator=gen) * 0.5).to(DEVICE)
    logits = torch.randn(n, h, generator=gen).to(DEVICE, dtype)
    g = kda_gate(g_raw, a_log, dt_bias, k)
    beta = torch.sigmoid(logits.float())
    pool = torch.randn(num_slots, h, k, v, device=DEVICE) * 0.1
    slots = torch.tensor([3, 0, 4], device=DEVICE)
    ref_pool = pool.clone()
    want = fused_recurrent_kda_slots(q, kk, vv, g, beta, ref_pool, slots)
    raw = g_raw.view(n, h, k)
    got = fused_recurrent_kda_slots(q, kk, vv, raw, logits, pool, slots, gate=(a_log, dt_bias), beta_logits=True)
    assert_close("o", want, got, 1e-5 if dtype == torch.float32 else 1e-2)
    assert_close("state", ref_pool, pool, 1e-5)
    with pytest.raises(ValueError, match="gate must be"):
        fused_recurrent_kda_slots(q, kk, vv, raw, logits, pool, slots, gate=(a_log[:1], dt_bias))


def _ref_spec(q, kk, vv, g, beta, pool, idx, acc: list[int], cu: list[int]):
    """Spec verify by the naive recurrence: sequence i starts from slot idx[i, acc[i] - 1] and writes the
    state after its token t to idx[i, t]. Returns (o, the pool after)."""
    ref_pool, ref_o = pool.clone(), torch.zeros(cu[-1], *vv.shape[1:], device=DEVICE)
    for i in range(len(cu) - 1):
        if cu[i + 1] == cu[i]:
            continue
        state = ref_pool[idx[i, acc[i] - 1]].clone()
        for t in range(cu[i + 1] - cu[i]):
            row = cu[i] + t
            o, state = _ref_step(q, kk, vv, g, beta, slice(row, row + 1), state)
            ref_o[row] = o[0]
            ref_pool[idx[i, t]] = state
    return ref_o, ref_pool


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_spec_2d_slots(varlen):
    """Read slot idx[n, acc-1]; write the state after token t to idx[n, t]; length-0 sequences are padding."""
    h, k, v, width = 2, 32, 32, 3
    lens = [3, 2, 0, 1] if varlen else [3, 3, 3]
    n = len(lens)
    idx = torch.arange(1, 1 + n * width, device=DEVICE).view(n, width)  # slot 0 never touched
    acc = torch.tensor([2, 1, 3, 1][:n], device=DEVICE)
    cu = [0, *itertools.accumulate(lens)]
    q, kk, vv, g, beta = _inputs(cu[-1], h, k, v, seed=1)
    pool = torch.randn(1 + n * width, h, k, v, device=DEVICE) * 0.1
    ref_o, ref_pool = _ref_spec(q, kk, vv, g, beta, pool, idx, acc.tolist(), cu)
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
    cu = [0, *itertools.accumulate(lens)]
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


@pytest.mark.parametrize("lens", [[100], [1, 64, 130, 7], [64, 0, 65]], ids=["one", "varlen", "empty-seq"])
def test_chunk_layout_is_flas_tables(lens):
    """The host-built tables equal fla's own prepare_chunk_indices / prepare_chunk_offsets."""
    from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets

    cu = [0, *itertools.accumulate(lens)]
    layout = chunk_layout(cu, DEVICE)
    ref_cu = torch.tensor(cu)
    assert torch.equal(layout.chunk_indices.cpu(), prepare_chunk_indices(ref_cu, 64))
    assert torch.equal(layout.chunk_offsets.cpu(), prepare_chunk_offsets(ref_cu, 64))
    assert layout.cu.tolist() == cu and layout.cu_cpu.tolist() == cu and layout.num_seqs == len(lens)
    with pytest.raises(ValueError, match="not decrease"):
        chunk_layout([0, 5, 3], DEVICE)


@needs_cuda
@pytest.mark.parametrize("with_h", [False, True], ids=["final", "states"])
@pytest.mark.parametrize("lens", [[8192], [1, 64, 130, 7]], ids=["8k", "varlen"])
def test_chunk_kda_varlen_is_flas_chunk_kda(lens, with_h):
    """The direct call of fla's forward gives fla's public chunk_kda bit for bit (bf16, the served dtype)."""
    from fla.ops.kda import chunk_kda

    h, k, v = 4, 128, 128
    cu = [0, *itertools.accumulate(lens)]
    q, kk, vv, g, beta = _inputs(cu[-1], h, k, v, torch.bfloat16, seed=5)
    init = torch.randn(len(lens), h, k, v, device=DEVICE) * 0.1
    o, final, states = chunk_kda_varlen(q, kk, vv, g, beta, init, chunk_layout(cu, DEVICE), with_h)
    cu_t = torch.tensor(cu)
    kw = dict(initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_t.cuda())
    with torch.inference_mode():
        ref = chunk_kda(*(x[None] for x in (q, kk, vv, g, beta)), return_intermediate_states=with_h, **kw)
    assert torch.equal(o, ref[0][0]) and torch.equal(final, ref[1])
    if with_h:
        assert torch.equal(states, ref[2][0])


# --- kernels/kda/recurrent_launch.py: fla's recurrent kernel with our own tile ---------------------------------

TILE_BVS = (8, 16, 32, 64, 128)  # 32 is fla's; 64 and 128 exceed V=16/32 here (masked lanes)


def _fla_wrapper(q, k, v, g, beta, pool, idx, acc=None, cu=None):
    """fla's own wrapper (BV 32, 4 warps, 2 stages) on fla-layout inputs: what the launcher must reproduce."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    o, _ = fused_recurrent_kda_fwd(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        initial_state=pool,
        inplace_final_state=True,
        cu_seqlens=cu,
        ssm_state_indices=idx,
        num_accepted_tokens=acc,
        use_qk_l2norm_in_kernel=True,
    )
    return o


def _same(name: str, ref: torch.Tensor, out: torch.Tensor) -> None:
    """Same launch, other tile: bit-for-bit under the interpreter (numpy reduces each V column alike whatever
    BV is). On a GPU the tile changes the layout, hence the K-reduction order: fp32 within 1e-6 (+ a few ulp),
    a bf16 output within one bf16 ulp (a last-bit fp32 difference can flip its rounding)."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"{name}: dtype {out.dtype} != {ref.dtype}"
    if not ON_CUDA:
        rtol = atol = 0.0
    else:
        rtol, atol = (1e-5 if out.dtype == torch.float32 else 2**-7), 1e-6
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("k", "v"), [(16, 16), (32, 32)], ids=["kv16", "kv32"])
@pytest.mark.parametrize("bv", TILE_BVS)
def test_tile_decode_matches_fla(bv, k, v, dtype):
    """Decode through the adapter with a tile: 3 sequences on permuted slots of an 8-slot pool."""
    h, n = 2, 3
    q, kk, vv, g, beta = _inputs(n, h, k, v, dtype, seed=10 + bv)
    pool = torch.randn(8, h, k, v, generator=torch.Generator().manual_seed(bv)).to(DEVICE) * 0.1
    slots = torch.randperm(8, generator=torch.Generator().manual_seed(bv))[:n].to(DEVICE)
    ref_pool, ref_o = pool.clone(), []
    for i in range(n):
        o, s = _ref_step(q, kk, vv, g, beta, slice(i, i + 1), ref_pool[slots[i]])
        ref_o.append(o)
        ref_pool[slots[i]] = s
    fla_pool = pool.clone()
    fla_o = _fla_wrapper(*(x[:, None] for x in (q, kk, vv, g, beta)), fla_pool, slots.to(torch.int32))[:, 0]
    out = fused_recurrent_kda_slots(q, kk, vv, g, beta, pool, slots, tile=RecurrentTile(bv=bv))
    _same("o vs fla", fla_o, out)
    _same("pool vs fla", fla_pool, pool)
    ratio = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close("o vs naive", torch.cat(ref_o), out, ratio)
    assert_close("pool vs naive", ref_pool, pool, ratio)


@pytest.mark.parametrize(("k", "v"), [(16, 16), (32, 32)], ids=["kv16", "kv32"])
@pytest.mark.parametrize("bv", TILE_BVS)
def test_tile_spec_matches_fla(bv, k, v):
    """Spec verify through the launcher: 2-D permuted slots, accepted counts, varlen with a padding sequence."""
    h, width = 2, 3
    lens, acc_l = [3, 0, 2, 1], [2, 1, 3, 1]
    n, num_slots = len(lens), 4 * width + 3
    cu = [0, *itertools.accumulate(lens)]
    q, kk, vv, g, beta = _inputs(cu[-1], h, k, v, seed=20 + bv)
    gen = torch.Generator().manual_seed(bv)
    pool = (torch.randn(num_slots, h, k, v, generator=gen) * 0.1).to(DEVICE)
    idx = torch.randperm(num_slots, generator=gen)[: n * width].view(n, width).to(DEVICE, torch.int32)
    acc = torch.tensor(acc_l, dtype=torch.int32, device=DEVICE)
    cu_t = torch.tensor(cu, dtype=torch.int64, device=DEVICE)
    ref_o, ref_pool = _ref_spec(q, kk, vv, g, beta, pool, idx, acc_l, cu)
    flat = [x[None] for x in (q, kk, vv, g, beta)]
    fla_pool = pool.clone()
    fla_o = _fla_wrapper(*flat, fla_pool, idx, acc, cu_t)
    out = launch_fused_recurrent_kda(*flat, pool, idx, acc, cu_t, RecurrentTile(bv=bv))
    _same("o vs fla", fla_o, out)
    _same("pool vs fla", fla_pool, pool)
    assert_close("o vs naive", ref_o, out[0], 1e-5)
    assert_close("pool vs naive", ref_pool, pool, 1e-5)


def test_default_tile_is_fla_wrapper_tile():
    """DEFAULT_RECURRENT_TILE must stay fla's own choice: a pin on the pinned wrapper's source."""
    import inspect

    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    src = inspect.getsource(inspect.unwrap(fused_recurrent_kda_fwd))
    tile = DEFAULT_RECURRENT_TILE
    assert f"BV = {tile.bv}\n" in src
    assert f"num_warps={tile.num_warps}," in src and f"num_stages={tile.num_stages}," in src
    assert tile == RecurrentTile(32, 4, 2)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"bv": 4}, "bv"),
        ({"bv": 12}, "bv"),
        ({"bv": 256}, "bv"),
        ({"bv": 32.0}, "bv"),
        ({"num_warps": 3}, "num_warps"),
        ({"num_warps": 16}, "num_warps"),
        ({"num_stages": 0}, "num_stages"),
        ({"num_stages": 5}, "num_stages"),
        ({"num_stages": True}, "num_stages"),
    ],
)
def test_recurrent_tile_validates(kw, field):
    with pytest.raises(ValueError, match=rf"RecurrentTile\.{field} must be"):
        RecurrentTile(**kw)


def test_launcher_validates():
    q, kk, vv, g, beta = (x[None] for x in _inputs(2, 2, 16, 16))
    pool = torch.zeros(4, 2, 16, 16, device=DEVICE)
    with pytest.raises(TypeError, match="RecurrentTile"):
        launch_fused_recurrent_kda(q, kk, vv, g, beta, pool, torch.tensor([0], device=DEVICE), None, None, (8, 4, 2))
    idx = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE).expand(2, 3)  # last-dim stride 0
    with pytest.raises(ValueError, match="contiguous last dim"):
        launch_fused_recurrent_kda(q, kk, vv, g, beta, pool, idx, None, None)
    with pytest.raises(ValueError, match="out must be"):
        launch_fused_recurrent_kda(q, kk, vv, g, beta, pool, idx[:, 0], None, None, out=torch.empty_like(q[..., :8]))


def test_launcher_passes_the_tile(monkeypatch):
    """The tile reaches the launch (outputs alone cannot tell: every tile computes the same thing)."""
    import fla.ops.kda.fused_recurrent as fr

    seen = []

    class Spy:
        def __getitem__(self, grid):
            def launch(**kw):
                seen.append((grid, kw["BV"], kw["num_warps"], kw["num_stages"]))
                return fr_kernel[grid](**kw)

            return launch

    fr_kernel = fr.fused_recurrent_kda_fwd_kernel
    monkeypatch.setattr(fr, "fused_recurrent_kda_fwd_kernel", Spy())
    q, kk, vv, g, beta = _inputs(3, 2, 16, 32)
    pool = torch.zeros(5, 2, 16, 32, device=DEVICE)
    slots = torch.tensor([4, 1, 2], device=DEVICE)
    fused_recurrent_kda_slots(q, kk, vv, g, beta, pool, slots, tile=RecurrentTile(8, 2, 3))
    fused_recurrent_kda_slots(q, kk, vv, g, beta, pool, slots)  # tile_for(3): 32 columns, 2 warps
    assert seen == [((4 * 3 * 2,), 8, 2, 3), ((1 * 3 * 2,), 32, 2, 2)]


@pytest.mark.parametrize(("n", "bv"), [(1, 32), (47, 32), (48, 64), (512, 64)])
def test_tile_for_the_batch(n, bv):
    assert tile_for(n) == RecurrentTile(bv=bv, num_warps=2, num_stages=2)
