"""The weight's L2 prefetch before a PDL launch's wait (kernels/pdl.py, kernels/gemv/triton.py): the pieces a
kernel's lanes ask for cover the slice once (under the interpreter), the budget switch, which launches take it,
its place before ``griddepcontrol.wait`` in the sm_90 PTX, and on a Hopper GPU the same bits with it as without."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import kernels.pdl as pdl
from kernels.gemv import triton as gemv_mod
from kernels.prefetch.triton import record_span_pieces
from tests.kernels.helpers import DEVICE, ON_CUDA

HOPPER = ON_CUDA and torch.cuda.get_device_capability()[0] >= 9


@pytest.fixture
def env_switch(monkeypatch):
    """Set TANDEM_PDL / TANDEM_PDL_PREFETCH_MB for the test (each is read once per process otherwise)."""

    def set_to(name: str, value: str) -> None:
        monkeypatch.setenv(name, value)
        pdl._switch.cache_clear()
        pdl.prefetch_budget_bytes.cache_clear()

    yield set_to
    pdl._switch.cache_clear()
    pdl.prefetch_budget_bytes.cache_clear()


@pytest.mark.parametrize("lanes", [32, 128, 256])
@pytest.mark.parametrize("nbytes", [16, 4608, 8 * 4096 * 2, 32 * 2304 * 2, 1_048_576, 16 * 1000 + 16])
def test_span_pieces_cover_the_slice_once(nbytes, lanes):
    out = record_span_pieces(nbytes, lanes, DEVICE).cpu().tolist()
    at = 0
    for off, size in out:
        if size <= 0:
            continue  # a lane past the end asks nothing
        assert off == at and off % 16 == 0 and size % 16 == 0, (off, size, at)
        at += size
    assert at == nbytes
    sizes = [s for _, s in out if s > 0]
    assert all(s == sizes[0] for s in sizes[:-1]) and sizes[-1] <= sizes[0]  # equal chunks, the last one shorter


def test_span_pieces_argument_errors():
    for nbytes, lanes in ((0, 32), (24, 32), (32, 48)):
        with pytest.raises(ValueError, match="multiple of 16"):
            record_span_pieces(nbytes, lanes)


def test_budget_switch(env_switch):
    env_switch("TANDEM_PDL_PREFETCH_MB", "16")
    assert pdl.prefetch_budget_bytes() == 16 * 2**20
    env_switch("TANDEM_PDL_PREFETCH_MB", "0")
    assert pdl.prefetch_budget_bytes() == 0
    env_switch("TANDEM_PDL_PREFETCH_MB", "0.001")
    assert pdl.prefetch_budget_bytes() == 1040  # rounded down to 16 bytes
    for bad in ("-1", "lots", "4096"):
        env_switch("TANDEM_PDL_PREFETCH_MB", bad)
        with pytest.raises(ValueError, match="TANDEM_PDL_PREFETCH_MB"):
            pdl.prefetch_budget_bytes()


def test_default_budget(monkeypatch):
    monkeypatch.delenv("TANDEM_PDL_PREFETCH_MB", raising=False)
    pdl.prefetch_budget_bytes.cache_clear()
    try:
        assert pdl.prefetch_budget_bytes() == 0  # measured slower on the H200 (kernels/pdl.py)
    finally:
        pdl.prefetch_budget_bytes.cache_clear()


def test_which_weights_take_it(env_switch):
    """A program's share of the budget, in 16-byte multiples; nothing for a weight the bulk prefetch cannot take."""
    env_switch("TANDEM_PDL_PREFETCH_MB", "16")
    w = torch.zeros(2304, 4096, dtype=torch.bfloat16)
    assert gemv_mod._prefetch_bytes(w, 288) == 16 * 2**20 // 288 // 16 * 16
    assert gemv_mod._prefetch_bytes(w[:, :4000], 288) == 0  # rows strided: not one range
    misaligned = torch.zeros(2304 * 4096 + 1, dtype=torch.bfloat16)[1:].view(2304, 4096)
    assert misaligned.is_contiguous() and gemv_mod._prefetch_bytes(misaligned, 288) == 0
    assert gemv_mod._prefetch_bytes(torch.zeros(40, 100, dtype=torch.bfloat16), 5) == 0  # 200-byte rows
    env_switch("TANDEM_PDL_PREFETCH_MB", "0")
    assert gemv_mod._prefetch_bytes(w, 288) == 0


_COMPILE = """
import json, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.gemv.triton import _gemv_kernel
prefetch = sys.argv[1] == "1"
names = ["X", "W", "Y", "M", "N", "K", "stride_x", "stride_w", "stride_y", "RES", "NW", "OUT", "RES_OUT", "TICKET",
         "eps", "PF_BYTES"]
types = ["*bf16", "*bf16", "*bf16", "i32", "i32", "i32", "i32", "i32", "i32", "*bf16", "*bf16", "*bf16", "*bf16",
         "*i32", "fp32", "i64"]
consts = dict(ONE_ROW=True, BLOCK_M=16, BLOCK_N=8, BLOCK_K=1024, EVEN_K=True, DOT_F32=False, PREC="tf32",
              NORM_AFTER=False, BLOCK_H=4096, USE_PDL=True, PDL_PREFETCH=prefetch, PF_LANES=256)
sig = dict(zip(names, types)) | {k: "constexpr" for k in consts}
order = list(sig)
src = ASTSource(_gemv_kernel, sig, {(order.index(k),): v for k, v in consts.items()})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3,
                                                                   "launch_pdl": True})
ptx = k.asm["ptx"]
print(json.dumps({"prefetch_at": ptx.find("cp.async.bulk.prefetch.L2.global"),
                  "wait_at": ptx.find("griddepcontrol.wait"), "first_load_at": ptx.find("ld.global"),
                  "cubin": len(k.asm["cubin"])}))
"""


@pytest.mark.skipif(ON_CUDA, reason="compiles for sm_90 on a host without a GPU; on a GPU the test below launches it")
@pytest.mark.parametrize("prefetch", [True, False])
def test_prefetch_is_issued_before_the_wait_in_the_ptx(prefetch):
    """The point of it: the weight's bytes are asked for before griddepcontrol.wait, every load of the kernel's
    inputs after it; without PDL_PREFETCH no prefetch is compiled in."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-c", _COMPILE, "1" if prefetch else "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["cubin"] > 0 and got["wait_at"] > 0, got
    if prefetch:
        assert 0 < got["prefetch_at"] < got["wait_at"] < got["first_load_at"], got
    else:
        assert got["prefetch_at"] == -1 and got["wait_at"] < got["first_load_at"], got


@pytest.mark.skipif(not HOPPER, reason="PDL needs a GPU of compute capability 9.0+ (CI has no GPU)")
@pytest.mark.parametrize(("n", "k"), [(12576, 2304), (2304, 4096), (6720, 2304), (40, 104)])
def test_gemv_bits_with_the_prefetch(env_switch, n, k):
    """A chain of one-row GEMVs with PDL and the prefetch (budget large enough to cover the weights, and small)
    gives the bits of PDL off, eagerly and replayed from a CUDA graph."""
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w1 = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    w2 = (torch.randn(k, n, device="cuda", generator=gen) / n**0.5).bfloat16()
    xs = [torch.randn(1, k, device="cuda", generator=gen).bfloat16() for _ in range(3)]

    def chain(x: torch.Tensor) -> torch.Tensor:
        return gemv_mod.gemv(gemv_mod.gemv(gemv_mod.gemv(x, w1), w2), w1)

    env_switch("TANDEM_PDL", "0")
    want = [chain(x) for x in xs]
    env_switch("TANDEM_PDL", "gemv")
    for mb in ("64", "1"):
        env_switch("TANDEM_PDL_PREFETCH_MB", mb)
        assert gemv_mod._prefetch_bytes(w1, 1) > 0
        for x, ref in zip(xs, want, strict=True):
            assert torch.equal(chain(x), ref)
        static_x = xs[0].clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static_x)
        for x, ref in zip(xs, want, strict=True):
            static_x.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, ref)
