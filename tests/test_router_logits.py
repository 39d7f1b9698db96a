"""engine/models/layers.router_logits: HF's fp32 router GEMM; on CUDA with bf16 operands one bf16 GEMM with fp32
accumulation and output (the products of bf16 values are exact in fp32: only the summation order differs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models import layers
from engine.models.layers import router_logits


def _operands(device: str, tokens: int = 37, hidden: int = 2304, experts: int = 256):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(experts, hidden, generator=g) * hidden**-0.5).to(device, torch.bfloat16)
    return x, w


def test_host_path_is_hf_fp32_form_bit_for_bit():
    x, w = _operands("cpu")
    want = F.linear(x.float(), w.float())
    assert torch.equal(router_logits(x, w), want)
    assert torch.equal(router_logits(x, w, w.float()), want)
    assert torch.equal(router_logits(x.float(), w.float()), F.linear(x.float(), w.float()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bf16-GEMM path runs on CUDA only (CI has no GPU)")
@pytest.mark.parametrize("tokens", [1, 64, 8192])
def test_cuda_bf16_gemm_matches_the_fp32_gemm(tokens, monkeypatch):
    monkeypatch.setattr(layers, "_MM_OUT_DTYPE_FAILED", False)
    torch.backends.cuda.matmul.allow_tf32 = False
    x, w = _operands("cuda", tokens)
    got = router_logits(x, w, w.float())
    assert not layers._MM_OUT_DTYPE_FAILED, "torch.mm(out_dtype=float32) is not available on this torch"
    want = F.linear(x.double(), w.double())
    assert got.dtype == torch.float32 and got.shape == (tokens, 256)
    # fp32 sums on the tensor cores: ~2e-6 relative (an FMA sgemm ~1e-7); a bf16-rounded output would be ~2e-3
    rel = ((got.double() - want).norm() / want.norm()).item()
    assert rel < 1e-5, f"bf16-GEMM router relative error {rel:.3g}"
    fp32 = F.linear(x.float(), w.float())
    assert torch.equal(got.topk(8).indices.sort(1).values, fp32.topk(8).indices.sort(1).values)
