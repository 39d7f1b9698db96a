"""kernels/moe/route_gate_up.py's ``route_gate_up_down_norm``: one token's whole MoE block (routing, gate-up, down,
combine + residual add + next norm) in one launch, against the two launches it replaces (``route_gate_up``, then
``down_combine_norm``: bit for bit); the counters across launches and graph replays; bad input; the engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.moe import block_down
from kernels.moe.down_norm import down_combine_norm
from kernels.moe.route_gate_up import MAX_ROUTED, SYNC_SIZE, route_gate_up, route_gate_up_down_norm
from kernels.triton_utils import LaunchTicket
from tests.kernels.helpers import DEVICE, ON_CUDA
from tests.kernels.one_row_engine import one_row_launches
from tests.kernels.sm90_compile import Launch, compile_errors, loop_bodies, ptx_of, record_launches
from tests.kernels.test_moe_route_gate_up import _inputs as route_gate_up_inputs


def _inputs(h: int, e: int, i: int, extra: bool, dtype: torch.dtype, seed: int, device=DEVICE):
    """The route + gate-up launch's inputs, then the down's: w2, the residual, the next norm's weight."""
    x, w, bias, w13 = route_gate_up_inputs(h, e, i, extra, dtype, seed, device)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    w2 = (torch.randn(e + extra, h, i, generator=gen, device=device) / i**0.5).to(dtype)
    residual = torch.randn(1, h, generator=gen, device=device).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(h, generator=gen, device=device)).to(dtype)
    return x, w, bias, w13, w2, residual, norm_w


def _two_launches(x, w, bias, w13, w2, residual, norm_w, k, extra):
    sync = torch.zeros(SYNC_SIZE, dtype=torch.int32, device=x.device)
    ticket = torch.zeros(1, dtype=torch.int32, device=x.device)
    weights, ids, a = route_gate_up(x, w, sync, bias, k, True, 2.446, w13, extra_expert=extra)
    return down_combine_norm(a, ids.reshape(-1), w2, weights, residual, norm_w, 1e-6, ticket)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("h", "e", "i", "k", "extra"), [(200, 40, 48, 4, True), (96, 24, 80, 6, False), (64, 16, 32, 1, True)]
)
def test_equals_the_two_launches_bit_for_bit(h, e, i, k, extra, dtype):
    x, w, bias, w13, w2, residual, norm_w = _inputs(h, e, i, extra, dtype, seed=h + e)
    shared = e if extra else None
    sync = LaunchTicket(SYNC_SIZE).get(x.device)
    want = _two_launches(x, w, bias, w13, w2, residual, norm_w, k, shared)
    # the second launch finds the counters put back to 0; the waits' knobs (off under the interpreter) change no bit
    for poll_ns, prefetch in ((0, False), (0, False), (500, True), (0, True)):
        got = route_gate_up_down_norm(
            x, w, sync, bias, k, True, 2.446, w13, w2, residual, norm_w, 1e-6, extra_expert=shared,
            poll_ns=poll_ns, prefetch=prefetch,
        )  # fmt: skip
        for name, g, wt in zip(("norm output", "residual"), got, want, strict=True):
            assert g.dtype == wt.dtype and torch.equal(g, wt), name
        assert not sync.any()
    # the down programs read the experts the routing chose: another routing, another output
    other = route_gate_up_down_norm(
        x, w.flip(0), sync, bias, k, True, 2.446, w13, w2, residual, norm_w, 1e-6, extra_expert=shared
    )
    assert not torch.equal(other[0], got[0])


@pytest.mark.skipif(not ON_CUDA, reason="a CUDA graph needs CUDA (the interpreter runs programs one by one)")
@pytest.mark.parametrize("acquire", [False, True], ids=["volatile_poll", "acquire_poll"])
def test_counters_survive_graph_replays(acquire):
    """Programs really run concurrently here, at Kimi's shapes (256 experts + the shared one, 2304 x 1024): the
    down programs wait inside the launch for their slot's gate-up programs, which wait for the router's (the flag
    polled with volatile or acquire loads); every replay with a new token equals the two launches and leaves the
    counters at 0."""
    x, w, bias, w13, w2, residual, norm_w = _inputs(2304, 256, 1024, True, torch.bfloat16, seed=3)
    sync = LaunchTicket(SYNC_SIZE).get(x.device)
    args = (bias, 8, True, 2.446, w13, w2, residual, norm_w, 1e-6)
    route_gate_up_down_norm(x, w, sync, *args, extra_expert=256, acquire=acquire)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = route_gate_up_down_norm(x, w, sync, *args, extra_expert=256, acquire=acquire)
    gen = torch.Generator(device=x.device).manual_seed(11)
    for _ in range(50):
        x.copy_(torch.randn(x.shape, generator=gen, device=x.device).to(x))
        graph.replay()
        want = _two_launches(x, w, bias, w13, w2, residual, norm_w, 8, 256)
        for name, g, wt in zip(("norm output", "residual"), got, want, strict=True):
            assert torch.equal(g, wt), name
    assert not sync.any()


def test_bad_inputs_say_what_is_wrong():
    x, w, bias, w13, w2, residual, norm_w = _inputs(64, 16, 32, True, torch.float32, seed=1)
    sync = torch.zeros(SYNC_SIZE, dtype=torch.int32, device=DEVICE)
    args = (bias, 2, True, 1.0, w13)
    with pytest.raises(ValueError, match="w2 must be"):
        route_gate_up_down_norm(x, w, sync, *args, w2[:16], residual, norm_w, 1e-6, extra_expert=16, split=32)
    with pytest.raises(ValueError, match="w2 must be"):
        route_gate_up_down_norm(x, w, sync, *args, w2.transpose(1, 2), residual, norm_w, 1e-6, extra_expert=16)
    with pytest.raises(ValueError, match="residual"):
        route_gate_up_down_norm(x, w, sync, *args, w2, residual[:, :32], norm_w, 1e-6, extra_expert=16, split=32)
    with pytest.raises(ValueError, match="sync"):
        route_gate_up_down_norm(x, w, sync[:3], *args, w2, residual, norm_w, 1e-6, extra_expert=16, split=32)
    x, w, bias, w13, w2, residual, norm_w = _inputs(64, MAX_ROUTED + 4, 32, False, torch.float32, seed=2)
    with pytest.raises(ValueError, match=f"at most {MAX_ROUTED} experts"):
        route_gate_up_down_norm(x, w, sync, bias, MAX_ROUTED + 1, True, 1.0, w13, w2, residual, norm_w, 1e-6)
    assert not sync.any()


# ---- in the engine ------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("fla_unblocked")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU engine with interpreted kernels")
def test_one_token_steps_run_the_block_in_one_launch(tiny_models, monkeypatch):
    """Greedy tokens of the tiny Kimi model with the GPU backends and ``TANDEM_MOE_BLOCK_ONE_LAUNCH=1``, one
    sequence at a time (every decode step one row): the reference backends' tokens, each MoE layer of a decode
    step one launch, the down launch never at one token."""
    monkeypatch.setenv("TANDEM_MOE_BLOCK_ONE_LAUNCH", "1")
    rows, one_row_blocks = one_row_launches(
        tiny_models, monkeypatch, ["route_gate_up_down_norm", "route_gate_up", "down_combine_norm"]
    )
    assert len(rows["route_gate_up_down_norm"]) == one_row_blocks
    assert rows["route_gate_up"] == [] and rows["down_combine_norm"] == []


@pytest.mark.skipif(ON_CUDA, reason="records interpreted launches; on a GPU the tests above compile them anyway")
def test_compiles_for_sm90_and_both_waits_poll_with_volatile_loads():
    """The one-launch block in bf16 at Kimi's top-8 with the shared expert, compiled for the H200 on the host (as it
    is and with PDL on); both waits (the routed gate-up programs' for the flag, the down programs' for their slot)
    are ``ld.volatile`` loops, not one hoisted load."""
    x, w, bias, w13, w2, residual, norm_w = _inputs(256, 32, 64, True, torch.bfloat16, seed=4)
    sync = torch.zeros(SYNC_SIZE, dtype=torch.int32, device=DEVICE)
    with record_launches() as seen:
        route_gate_up_down_norm(x, w, sync, bias, 8, True, 1.0, w13, w2, residual, norm_w, 1e-6, extra_expert=32)
    launches = sorted(seen, key=str)
    assert len(launches) == 1
    assert compile_errors(launches) == []
    bodies = loop_bodies(ptx_of(launches[0]))
    assert sum("ld.volatile.global" in b for b in bodies) >= 2, "a wait is not a loop of volatile loads"


@pytest.mark.skipif(ON_CUDA, reason="records interpreted launches; on a GPU the tests above compile them anyway")
def test_the_waits_knobs_compile_to_a_sleep_and_a_bulk_prefetch():
    """The down programs with ``TANDEM_MOE_BLOCK_POLL_NS`` and ``TANDEM_MOE_BLOCK_PREFETCH`` on (off under the
    interpreter: set here in the recorded launch), compiled for sm_90: a ``nanosleep`` in the polls, one bulk
    prefetch a lane before the wait, and the routing's slot words written beside the flag."""
    x, w, bias, w13, w2, residual, norm_w = _inputs(256, 32, 64, True, torch.bfloat16, seed=4)
    sync = torch.zeros(SYNC_SIZE, dtype=torch.int32, device=DEVICE)
    with record_launches() as seen:
        route_gate_up_down_norm(x, w, sync, bias, 8, True, 1.0, w13, w2, residual, norm_w, 1e-6, extra_expert=32)
    (plain,) = seen
    knobs = {"POLL_NS": 500, "PREFETCH_LANES": 128}
    assert {k: v for k, v in plain.constexprs if k in knobs} == {"POLL_NS": 0, "PREFETCH_LANES": 0}
    on: Launch = dataclasses.replace(plain, constexprs=tuple((k, knobs.get(k, v)) for k, v in plain.constexprs))
    assert compile_errors([on]) == []
    ptx, ptx_off = ptx_of(on), ptx_of(plain)
    assert "nanosleep.u32" in ptx and "nanosleep" not in ptx_off
    assert "cp.async.bulk.prefetch.L2.global" in ptx and "cp.async.bulk.prefetch" not in ptx_off
    assert ptx.count("atom.global.gpu.relaxed.exch") > ptx_off.count("atom.global.gpu.relaxed.exch")


def test_wait_options_read_the_environment_and_refuse_bad_values(monkeypatch):
    """None takes the environment's knobs; bad values name the variable; the interpreter turns both off; the
    prefetch is off for a w2 whose rows do not start 16-byte aligned."""
    w2 = torch.zeros(4, 16, 32, dtype=torch.bfloat16)
    monkeypatch.setattr(block_down, "is_interpreting", lambda: False)
    monkeypatch.setenv(block_down.POLL_NS_ENV, "250")
    monkeypatch.setenv(block_down.PREFETCH_ENV, "1")
    assert block_down.wait_options(None, None, w2) == (250, True)
    assert block_down.wait_options(0, False, w2) == (0, False)  # the arguments win
    assert block_down.wait_options(None, None, w2[:, :, 1:]) == (250, False)  # rows 62 bytes apart
    monkeypatch.setenv(block_down.POLL_NS_ENV, "soon")
    with pytest.raises(ValueError, match=block_down.POLL_NS_ENV):
        block_down.wait_options(None, False, w2)
    with pytest.raises(ValueError, match="poll_ns must be in"):
        block_down.wait_options(-1, False, w2)
    monkeypatch.setenv(block_down.PREFETCH_ENV, "yes")
    with pytest.raises(ValueError, match=block_down.PREFETCH_ENV):
        block_down.wait_options(0, None, w2)
    monkeypatch.setattr(block_down, "is_interpreting", lambda: True)
    assert block_down.wait_options(250, True, w2) == (0, False)
