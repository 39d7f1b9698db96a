"""kernels/pdl.py: when the decode kernels launch with programmatic dependent launch, and that a chain of them gives
the same bits with it as without it, eagerly and replayed from a CUDA graph (on a Hopper GPU: each kernel reads what
the one before it wrote, so a kernel that started before its predecessor's writes landed would read stale rows)."""

from __future__ import annotations

import inspect
import itertools
import re
from pathlib import Path

import pytest
import torch

import kernels.pdl as pdl
from kernels.gemv.triton import gemv
from kernels.moe.triton import sigmoid_topk_route_triton
from kernels.sampling.triton import argmax_rows
from tests.kernels.helpers import DEVICE, ON_CUDA

HOPPER = ON_CUDA and torch.cuda.get_device_capability()[0] >= 9


@pytest.fixture
def pdl_switch(monkeypatch):
    """Set TANDEM_PDL for the test (the switch is read once per process otherwise)."""

    def set_to(value: str) -> None:
        monkeypatch.setenv("TANDEM_PDL", value)
        pdl._switch.cache_clear()

    yield set_to
    pdl._switch.cache_clear()


def test_off_by_default(monkeypatch):
    """A launch pair on the decode path still races with PDL on (kernels/pdl.py's docstring): opt-in only."""
    monkeypatch.delenv("TANDEM_PDL", raising=False)
    pdl._switch.cache_clear()
    try:
        assert pdl.use_pdl(torch.zeros(2, device=DEVICE), "gemv.gemv") is False
    finally:
        pdl._switch.cache_clear()


def test_off_the_gpu_and_when_switched_off(pdl_switch):
    cpu = torch.zeros(2)
    assert pdl.use_pdl(cpu, "gemv.gemv") is False
    assert pdl.pdl_kwargs(cpu, "moe.route") == {"USE_PDL": False, "launch_pdl": False}
    pdl_switch("0")
    assert pdl.use_pdl(torch.zeros(2, device=DEVICE), "gemv.gemv") is False


def test_bad_switch_names_the_variable(pdl_switch):
    pdl_switch("yes")
    with pytest.raises(ValueError, match=r"TANDEM_PDL must be 0, 1 or a comma list of families \(gemv, moe.*got 'yes'"):
        pdl.use_pdl(torch.zeros(2), "gemv.gemv")
    pdl_switch("gemv,moe.nope")
    with pytest.raises(ValueError, match="TANDEM_PDL must be"):
        pdl.use_pdl(torch.zeros(2), "gemv.gemv")
    pdl_switch("gemv,moe")
    with pytest.raises(ValueError, match=r"unknown PDL launch site 'norm\.rms'"):
        pdl.use_pdl(torch.zeros(2), "norm.rms")
    with pytest.raises(ValueError, match="unknown PDL launch site 'gemv'"):  # a family is not a site
        pdl.use_pdl(torch.zeros(2), "gemv")


def test_a_family_list_switches_on_those_families(pdl_switch):
    pdl_switch(" moe , gemv, sampling.row_argmax")
    assert pdl._switch() == {"moe", "gemv", "sampling.row_argmax"}
    pdl_switch("1")
    assert pdl._switch() == set(pdl.FAMILIES)
    pdl_switch("0")
    assert pdl._switch() == set()


def test_a_site_switches_on_that_launch_only_and_a_family_all_of_its_own(pdl_switch):
    pdl_switch("moe.align,sampling")
    assert pdl.switched_on("moe.align") and not pdl.switched_on("moe.combine")
    assert pdl.switched_on("sampling.chunk_max") and pdl.switched_on("sampling.row_argmax")
    assert not pdl.switched_on("gemv.gemv")
    pdl_switch("1")
    assert all(pdl.switched_on(f"{f}.{k}") for f, ks in pdl.SITES.items() for k in ks)
    pdl_switch("0")
    assert not any(pdl.switched_on(f"{f}.{k}") for f, ks in pdl.SITES.items() for k in ks)


def test_every_launch_site_is_registered_and_every_registered_site_launches():
    """kernels.pdl.SITES is what TANDEM_PDL and bench/pdl_check.py bisect over: it must list exactly the sites
    the kernels pass to pdl_kwargs."""
    root = Path(pdl.__file__).parent
    used = {
        m.group(1)
        for path in root.rglob("*.py")
        for m in re.finditer(r'pdl_kwargs\([^()]*?,\s*"([a-z_]+\.[a-z_]+)"\)', path.read_text())
    }
    registered = {f"{f}.{k}" for f, ks in pdl.SITES.items() for k in ks}
    assert used == registered, (sorted(used - registered), sorted(registered - used))


def _chain(x: torch.Tensor, weights: list[torch.Tensor], router: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """GEMV after GEMV (each reading the previous output), then routing and an argmax on the last one."""
    h = x
    for w in weights:
        h = gemv(h, w)
    w_top, ids = sigmoid_topk_route_triton(gemv(h, router).float(), None, 8, True, 2.5)
    return h, w_top, ids, argmax_rows(h.float())


@pytest.mark.skipif(not HOPPER, reason="PDL needs a GPU of compute capability 9.0+ (CI has no GPU)")
def test_chain_is_bit_equal_with_and_without_pdl(pdl_switch):
    gen = torch.Generator(device="cuda").manual_seed(0)
    dims = [2304, 12576, 2304, 6720, 2304]  # wide then narrow: long producers feeding short consumers
    weights = [
        (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16() for k, n in itertools.pairwise(dims)
    ]
    router = (torch.randn(256, dims[-1], device="cuda", generator=gen) / 48).bfloat16()
    xs = [torch.randn(1, dims[0], device="cuda", generator=gen).bfloat16() for _ in range(4)]

    pdl_switch("0")
    assert not pdl.use_pdl(xs[0], "gemv.gemv")
    expected = [_chain(x, weights, router) for x in xs]
    pdl_switch("1")
    assert pdl.use_pdl(xs[0], "gemv.gemv") and pdl.use_pdl(xs[0], "moe.route")
    for x, want in zip(xs, expected, strict=True):
        for got, ref in zip(_chain(x, weights, router), want, strict=True):
            assert torch.equal(got, ref)

    static_x = xs[0].clone()
    _chain(static_x, weights, router)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _chain(static_x, weights, router)
    for _ in range(3):
        for x, want in zip(xs, expected, strict=True):
            static_x.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            for got, ref in zip(outs, want, strict=True):
                assert torch.equal(got, ref)


def test_the_planner_does_not_let_flashmla_start_early():
    """FlashMLA's split kernel launches with PDL and reads its plan without waiting, so the planner right before it
    must not trigger its dependents early (kernels/pdl.py); every other PDL kernel waits, then triggers."""
    from kernels.flashmla import plan
    from kernels.gemv import triton as gemv_mod

    planner = inspect.getsource(plan._even_blocks_plan_kernel.fn)
    assert "pdl_wait(USE_PDL)" in planner and "pdl_enter" not in planner
    assert "pdl_enter(USE_PDL)" in inspect.getsource(gemv_mod._gemv_kernel.fn)
