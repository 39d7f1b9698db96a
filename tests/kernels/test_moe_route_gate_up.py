"""kernels/moe/route_gate_up.py: one token's routing and its experts' gate-up in one launch, against the two
launches it replaces (``router_route``, then the pair-row gate-up of ``moe_experts_decode``: bit for bit); the
counters across launches and graph replays; bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.moe.route_gate_up import MAX_ROUTED, SYNC_SIZE, route_gate_up, route_then_gate_up
from kernels.moe.router import SPLIT_K, route_split_from_env
from kernels.triton_utils import LaunchTicket
from tests.kernels.helpers import DEVICE, ON_CUDA
from tests.kernels.one_row_engine import one_row_launches
from tests.kernels.sm90_compile import compile_errors, loop_bodies, ptx_of, record_launches


def _inputs(h: int, e: int, i: int, extra: bool, dtype: torch.dtype, seed: int, device=DEVICE):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(1, h, generator=gen, device=device).to(dtype)
    w = (torch.randn(e, h, generator=gen, device=device) / h**0.5).to(dtype)
    bias = 0.1 * torch.randn(e, generator=gen, device=device)
    w13 = (torch.randn(e + extra, 2 * i, h, generator=gen, device=device) / h**0.5).to(dtype)
    return x, w, bias, w13


def _two_launches(x, w, bias, w13, k, extra):
    ticket = torch.zeros(1, dtype=torch.int32, device=x.device)
    return route_then_gate_up(x, w, ticket, bias, k, True, 2.446, w13, extra_expert=extra)


@pytest.mark.parametrize("slot_words", [False, True], ids=["flag", "slot_words"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("h", "e", "i", "k", "extra"), [(200, 40, 48, 4, True), (96, 24, 80, 6, False), (64, 16, 32, 1, True)]
)
def test_equals_the_two_launches_bit_for_bit(h, e, i, k, extra, dtype, slot_words):
    x, w, bias, w13 = _inputs(h, e, i, extra, dtype, seed=h + e)
    sync = LaunchTicket(SYNC_SIZE).get(x.device)
    want = _two_launches(x, w, bias, w13, k, e if extra else None)
    for _ in range(2):  # the second launch finds the counters put back to 0
        got = route_gate_up(
            x, w, sync, bias, k, True, 2.446, w13, extra_expert=e if extra else None, slot_words=slot_words
        )
        for name, g, wt in zip(("weights", "ids", "gate-up"), got, want, strict=True):
            assert torch.equal(g, wt), name
        assert not sync.any()
    assert got[2].shape == (k + extra, i)
    # the gate-up reads the experts the routing chose: another routing, other rows
    other = route_gate_up(
        x, w.flip(0), sync, bias, k, True, 2.446, w13, extra_expert=e if extra else None, slot_words=slot_words
    )
    assert not torch.equal(other[1], got[1]) and not torch.equal(other[2], got[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("split", [16, 64, 512])
def test_another_router_split_equals_the_two_launches_at_that_split(split, dtype):
    """``TANDEM_MOE_ROUTE_SPLIT``'s launches: 13, 4 and 1 router column ranges at H = 200 (the last one short)."""
    x, w, bias, w13 = _inputs(200, 40, 48, True, dtype, seed=split)
    sync = LaunchTicket(SYNC_SIZE).get(x.device)
    ticket = torch.zeros(1, dtype=torch.int32, device=x.device)
    want = route_then_gate_up(x, w, ticket, bias, 4, True, 2.446, w13, extra_expert=40, split=split)
    got = route_gate_up(x, w, sync, bias, 4, True, 2.446, w13, extra_expert=40, split=split)
    for name, g, wt in zip(("weights", "ids", "gate-up"), got, want, strict=True):
        assert torch.equal(g, wt), name
    assert not sync.any()


def test_route_split_from_env(monkeypatch):
    monkeypatch.delenv("TANDEM_MOE_ROUTE_SPLIT", raising=False)
    assert route_split_from_env() == SPLIT_K
    monkeypatch.setenv("TANDEM_MOE_ROUTE_SPLIT", " 1024 ")
    assert route_split_from_env() == 1024
    for bad in ("8", "100", "-16", "x", "16.0", "8192", "\u00b2"):
        monkeypatch.setenv("TANDEM_MOE_ROUTE_SPLIT", bad)
        with pytest.raises(ValueError, match="TANDEM_MOE_ROUTE_SPLIT must be a power of two from 16 to 4096"):
            route_split_from_env()


@pytest.mark.skipif(not ON_CUDA, reason="a CUDA graph needs CUDA (the interpreter runs programs one by one)")
@pytest.mark.parametrize(
    ("slot_words", "acquire"), [(False, False), (True, False), (False, True)], ids=["flag", "slot_words", "acquire"]
)
def test_counters_survive_graph_replays(slot_words, acquire):
    """Programs really run concurrently here, at Kimi's shapes (256 experts + the shared one, 2304 x 1024): the
    routed slots' programs wait for the router's inside the launch (the flag polled with volatile or acquire loads,
    or the slot words); every replay with a new token equals the two launches and leaves the counters at 0."""
    x, w, bias, w13 = _inputs(2304, 256, 1024, True, torch.bfloat16, seed=3)
    sync = LaunchTicket(SYNC_SIZE).get(x.device)
    kw = dict(extra_expert=256, slot_words=slot_words, acquire=acquire)
    route_gate_up(x, w, sync, bias, 8, True, 2.446, w13, **kw)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = route_gate_up(x, w, sync, bias, 8, True, 2.446, w13, **kw)
    gen = torch.Generator(device=x.device).manual_seed(11)
    for _ in range(50):
        x.copy_(torch.randn(x.shape, generator=gen, device=x.device).to(x))
        graph.replay()
        want = _two_launches(x, w, bias, w13, 8, 256)
        for name, g, wt in zip(("weights", "ids", "gate-up"), got, want, strict=True):
            assert torch.equal(g, wt), name
    assert not sync.any()


def test_bad_inputs_say_what_is_wrong():
    x, w, bias, w13 = _inputs(64, 16, 32, True, torch.float32, seed=1)
    sync = torch.zeros(SYNC_SIZE, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="one token"):
        route_gate_up(x.expand(2, -1), w, sync, bias, 2, True, 1.0, w13, extra_expert=16, split=32)
    with pytest.raises(ValueError, match="sync"):
        route_gate_up(x, w, sync[:1], bias, 2, True, 1.0, w13, extra_expert=16, split=32)
    with pytest.raises(ValueError, match="too few"):
        route_gate_up(x, w, sync, bias, 2, True, 1.0, w13[:16], extra_expert=16, split=32)
    with pytest.raises(ValueError, match="w13"):
        route_gate_up(x, w, sync, bias, 2, True, 1.0, w13[..., :32], extra_expert=16, split=32)
    x, w, bias, w13 = _inputs(64, MAX_ROUTED + 4, 32, False, torch.float32, seed=2)
    with pytest.raises(ValueError, match=f"at most {MAX_ROUTED} experts"):
        route_gate_up(x, w, sync, bias, MAX_ROUTED + 1, True, 1.0, w13, split=32, slot_words=True)
    assert not sync.any()


# ---- in the engine ------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("fla_unblocked")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU engine with interpreted kernels")
@pytest.mark.parametrize(
    ("route_gate_up_on", "slot_words", "split"), [("1", "0", ""), ("1", "1", ""), ("0", "0", ""), ("1", "0", "32")]
)
def test_one_token_steps_route_inside_the_gate_up(tiny_models, monkeypatch, route_gate_up_on, slot_words, split):
    """Greedy tokens of the tiny Kimi model with the GPU backends, one sequence at a time (every decode step one
    row), weights packed as on CUDA: the reference backends' tokens with a MoE block in two launches (the fused
    route + gate-up ran once per MoE layer a decode step, the router's own launch never at one token) and with
    the routing in its own launch; the fused launch's routed programs told their experts by the flag or by the
    slot words; and with the router split as ``TANDEM_MOE_ROUTE_SPLIT`` sets it."""
    monkeypatch.setenv("TANDEM_MOE_ROUTE_GATE_UP", route_gate_up_on)
    monkeypatch.setenv("TANDEM_MOE_ROUTE_SPLIT", split)
    monkeypatch.setenv("TANDEM_MOE_ROUTE_SLOT_WORDS", slot_words)
    rows, one_row_blocks = one_row_launches(tiny_models, monkeypatch, ["route_gate_up", "router_route"])
    on = route_gate_up_on == "1"
    assert len(rows["route_gate_up"]) == (one_row_blocks if on else 0)
    assert rows["router_route"].count(1) == (0 if on else one_row_blocks)
    from engine.backends.gpu_moe import GPUMoEBackend

    assert GPUMoEBackend().route_split == (int(split) if split else SPLIT_K)  # what the launches were given


@pytest.mark.skipif(ON_CUDA, reason="records interpreted launches; on a GPU the tests above compile them anyway")
def test_both_forms_compile_for_sm90_and_poll_with_volatile_loads():
    """The flag and the slot words, each in bf16 at Kimi's top-8 with the shared expert, compiled for the H200 on
    the host (as it is and with PDL on); the waiters' polls are ``ld.volatile`` loops, not one hoisted load."""
    x, w, bias, w13 = _inputs(256, 32, 64, True, torch.bfloat16, seed=4)
    sync = torch.zeros(SYNC_SIZE, dtype=torch.int32, device=DEVICE)
    with record_launches() as seen:
        for slot_words in (False, True):
            route_gate_up(x, w, sync, bias, 8, True, 1.0, w13, extra_expert=32, slot_words=slot_words)
    launches = sorted(seen, key=str)
    assert len(launches) == 2
    assert compile_errors(launches) == []
    for launch in launches:
        bodies = loop_bodies(ptx_of(launch))
        assert any("ld.volatile.global" in b for b in bodies), "the poll is not a loop of volatile loads"


@pytest.mark.skipif(ON_CUDA, reason="records interpreted launches; on a GPU the tests above run the form itself")
def test_acquire_polls_compile_for_sm90_as_a_loop_of_acquire_loads():
    """``TANDEM_MOE_ROUTE_ACQUIRE_POLL`` (off under the interpreter: set here in the recorded launch), compiled for
    sm_90: the waiters poll with ``ld.acquire.gpu`` in a loop, and the acquire after the volatile poll (Triton emits
    ``atomic_add(0, sem="acquire")`` as ``ld.global.gpu.acquire``) is gone; the count moves after the rows."""
    x, w, bias, w13 = _inputs(256, 32, 64, True, torch.bfloat16, seed=4)
    sync = torch.zeros(SYNC_SIZE, dtype=torch.int32, device=DEVICE)
    with record_launches() as seen:
        route_gate_up(x, w, sync, bias, 8, True, 1.0, w13, extra_expert=32, acquire=True)
    (plain,) = seen
    assert dict(plain.constexprs)["ACQUIRE_POLL"] is False  # the interpreter has no inline PTX
    on = dataclasses.replace(
        plain, constexprs=tuple((k, True if k == "ACQUIRE_POLL" else v) for k, v in plain.constexprs)
    )
    assert compile_errors([on]) == []
    ptx, ptx_off = ptx_of(on), ptx_of(plain)
    assert any("ld.acquire.gpu" in b for b in loop_bodies(ptx)), "the poll is not a loop of acquire loads"
    assert "ld.acquire.gpu" not in ptx_off
    assert "ld.global.gpu.acquire" in ptx_off and "ld.global.gpu.acquire" not in ptx
    assert "ld.volatile.global" in ptx_off and "ld.volatile.global" not in ptx


def test_acquire_poll_switch(monkeypatch):
    from kernels.moe import flag_wait

    for raw, want in (("", False), ("0", False), ("1", True)):
        monkeypatch.setenv("TANDEM_MOE_ROUTE_ACQUIRE_POLL", raw)
        flag_wait.acquire_poll_from_env.cache_clear()
        assert flag_wait.acquire_poll_from_env() is want
    monkeypatch.setenv("TANDEM_MOE_ROUTE_ACQUIRE_POLL", "yes")
    flag_wait.acquire_poll_from_env.cache_clear()
    with pytest.raises(ValueError, match="TANDEM_MOE_ROUTE_ACQUIRE_POLL must be 0 or 1"):
        flag_wait.acquire_poll_from_env()
    monkeypatch.delenv("TANDEM_MOE_ROUTE_ACQUIRE_POLL")
    flag_wait.acquire_poll_from_env.cache_clear()
    # never under the interpreter (no inline PTX there); asked for, on a GPU
    assert flag_wait.acquire_poll(True) is (not flag_wait.is_interpreting())
