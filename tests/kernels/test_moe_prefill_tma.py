"""kernels/moe/prefill_tma.py (the gate-up GEMM with the weights through TMA descriptors) against the definition
and the pointer kernel it would replace; on the CPU under the interpreter, which runs tensor descriptors."""

from __future__ import annotations

import pytest
import torch

from kernels.moe.grouped import moe_align
from kernels.moe.prefill import GemmTiles, down_grouped, gate_up_fused
from kernels.moe.prefill_tma import down_tma, gate_up_tma, tma_usable
from tests.kernels.helpers import DEVICE, assert_close, tol
from tests.kernels.test_moe_prefill import _problem as moe_problem


def _problem(t: int, e: int, k: int, h: int, i: int, seed: int):
    x, w13, _, _, ids = moe_problem(t, e, k, h, i, seed)  # the pointer kernel's tests' problems
    return x, w13, moe_align(ids, e)


def _definition(x: torch.Tensor, w13: torch.Tensor, al) -> torch.Tensor:
    i = w13.shape[1] // 2
    rows = x[al.token]
    counts = torch.diff(al.offsets, prepend=al.offsets.new_zeros(1))
    expert = torch.repeat_interleave(torch.arange(w13.shape[0], device=x.device), counts)
    w = w13[expert]  # [N, 2I, H]
    h13 = torch.einsum("nh,nih->ni", rows, w)
    return torch.nn.functional.silu(h13[:, :i]) * h13[:, i:]


@pytest.mark.parametrize(
    ("t", "e", "k", "h", "i", "tiles"),
    [
        (37, 8, 2, 64, 48, GemmTiles(16, 32, 32, num_warps=4, num_stages=2)),  # a gate box runs into the up rows
        (29, 16, 4, 96, 32, GemmTiles(16, 32, 64, num_warps=4, num_stages=2)),  # H not a multiple of BLOCK_K
        (3, 16, 2, 64, 24, GemmTiles(16, 16, 32, num_warps=4, num_stages=3)),  # most experts empty; the last
        # expert's up box runs past the [E*2I, H] view's end (zero padded)
    ],
)
def test_tma_gate_up_matches_the_definition_and_the_pointer_kernel(t, e, k, h, i, tiles):
    x, w13, al = _problem(t, e, k, h, i, 5)
    got = gate_up_tma(x, al, w13, tiles)
    assert got.shape == (t * k, i)
    assert_close("tma vs definition", _definition(x, w13, al), got, tol(torch.float32))
    assert_close("tma vs pointer kernel", gate_up_fused(x, al, w13, tiles), got, tol(torch.float32))


def test_tma_gate_up_rejects_what_tma_cannot_read():
    x, w13, al = _problem(9, 4, 2, 64, 16, 1)
    tiles = GemmTiles(16, 16, 32, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="contiguous"):
        gate_up_tma(x, al, w13.transpose(1, 2).contiguous().transpose(1, 2), tiles)
    x2, w2, al2 = _problem(9, 4, 2, 66, 16, 1)  # 66 bf16 columns: 132-byte rows, not 16-byte aligned
    with pytest.raises(ValueError, match="16-byte"):
        gate_up_tma(x2.bfloat16(), al2, w2.bfloat16(), tiles)


def test_prefill_experts_take_the_tma_gate_up_where_usable(monkeypatch):
    """``moe_experts_prefill``: "tma" and "pointer" give the same rows; "auto" takes the TMA kernels only where
    ``tma_usable`` (Hopper, 16-bit, 16-byte rows): the gate-up with 3 stages from ``TMA_LONG_PAIRS`` pairs unless
    tiles are given, the down GEMM below that count; an unknown impl is refused by name."""
    import kernels.moe.prefill as prefill

    x, w13, w2, _, ids = moe_problem(45, 8, 2, 64, 32, 7)
    al = moe_align(ids, 8)
    tiles = GemmTiles(16, 32, 32, num_warps=4, num_stages=2)
    pointer = prefill.moe_experts_prefill(x, al, w13, w2, gate_up=tiles, down=tiles, gate_up_impl="pointer")
    tma = prefill.moe_experts_prefill(x, al, w13, w2, gate_up=tiles, down=tiles, gate_up_impl="tma")
    assert_close("tma vs pointer experts", pointer, tma, tol(torch.float32))
    with pytest.raises(ValueError, match="gate_up_impl"):
        prefill.moe_experts_prefill(x, al, w13, w2, gate_up_impl="cutlass")

    hopper = DEVICE.type == "cuda" and torch.cuda.get_device_capability() >= (9, 0)
    assert not tma_usable(x, w13)  # fp32 operands: never timed through TMA
    assert tma_usable(x.bfloat16(), w13.bfloat16()) == hopper
    assert not tma_usable(x.bfloat16()[:, :60], w13.bfloat16()[:, :, :60].contiguous())  # 120-byte rows

    stages, downs = [], []
    real, real_down = prefill.gate_up_tma, prefill.down_tma
    monkeypatch.setattr(prefill, "gate_up_tma", lambda *a: stages.append(a[3].num_stages) or real(*a))
    monkeypatch.setattr(prefill, "down_tma", lambda *a: downs.append(a[0].shape[0]) or real_down(*a))
    monkeypatch.setattr(prefill, "tma_usable", lambda x, w: True)
    monkeypatch.setattr(prefill, "TMA_LONG_PAIRS", 64)
    for t in (20, 45):  # 40 pairs, then 90; bf16 takes GATE_UP_TILES (4 stages)
        xx, ww13, ww2, _, ii = moe_problem(t, 8, 2, 64, 32, 8, torch.bfloat16)
        got = prefill.moe_experts_prefill(xx, moe_align(ii, 8), ww13, ww2, gate_up=None, down=tiles)
        assert got.shape == (ii.numel(), 64)
    assert stages == [4, 3]
    assert downs == [40]  # the down GEMM through TMA below TMA_LONG_PAIRS only (above: grouped_mm / triton)
    prefill.moe_experts_prefill(x, al, w13, w2, gate_up=tiles, down=tiles)  # given tiles keep their stages
    assert stages == [4, 3, 2]


@pytest.mark.parametrize(
    ("t", "e", "k", "h", "i", "tiles"),
    [
        (37, 8, 2, 48, 64, GemmTiles(16, 32, 32, num_warps=4, num_stages=2)),  # an H block runs into the next
        # expert's weight rows; row tiles run into the next expert's rows
        (29, 16, 4, 32, 96, GemmTiles(16, 32, 64, num_warps=4, num_stages=2)),  # I not a multiple of BLOCK_K
        (3, 16, 2, 24, 64, GemmTiles(16, 16, 32, num_warps=4, num_stages=3)),  # most experts empty; the last
        # row tile and the last expert's H block run past the views' ends (zero padded)
    ],
)
def test_tma_down_matches_the_definition_and_the_pointer_kernel(t, e, k, h, i, tiles):
    g = torch.Generator().manual_seed(9)
    _, _, w2, _, ids = moe_problem(t, e, k, h, i, 6)
    al = moe_align(ids, e)
    a = torch.randn(ids.numel(), i, generator=g).to(DEVICE)  # sorted rows
    got = down_tma(a, al, w2, tiles)
    assert got.shape == (t * k, h)
    want = torch.einsum("ni,nhi->nh", a, w2[_expert_of_rows(al, e)])
    assert_close("tma down vs definition", want, got, tol(torch.float32))
    assert_close("tma down vs pointer kernel", down_grouped(a, al, w2, tiles), got, tol(torch.float32))
    assert not torch.allclose(down_tma(a, al, w2.flip(0), tiles), got)  # each row tile reads its own expert


def _expert_of_rows(al, e: int) -> torch.Tensor:
    ends = al.offsets.cpu()
    return torch.repeat_interleave(torch.arange(e), torch.diff(ends, prepend=torch.zeros(1, dtype=ends.dtype))).to(
        DEVICE
    )


def test_tma_down_rejects_what_tma_cannot_read_and_runs_in_the_experts():
    import kernels.moe.prefill as prefill

    x, w13, w2, _, ids = moe_problem(21, 4, 2, 64, 36, 2)  # I = 36 fp32: 144-byte rows
    al = moe_align(ids, 4)
    tiles = GemmTiles(16, 16, 32, num_warps=4, num_stages=2)
    a = torch.randn(ids.numel(), 36).to(DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        down_tma(a.t().contiguous().t(), al, w2, tiles)
    with pytest.raises(ValueError, match="16-byte"):
        down_tma(a[:, :34].contiguous(), al, w2[:, :, :34].contiguous(), tiles)  # 136-byte rows
    kw = dict(gate_up=tiles, down=tiles)
    triton_down = prefill.moe_experts_prefill(x, al, w13, w2, down_impl="triton", **kw)
    assert_close(
        "experts, tma down",
        triton_down,
        prefill.moe_experts_prefill(x, al, w13, w2, down_impl="tma", **kw),
        tol(torch.float32),
    )
