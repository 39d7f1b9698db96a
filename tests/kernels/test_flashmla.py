"""kernels/flashmla: the selection and error paths everywhere; the kernel itself against the fp32 reference
on an sm90 GPU with the pinned sources present (bench/flashmla_check.py covers real shapes there)."""

from __future__ import annotations

import pytest
import torch

from kernels.flashmla.build import load_flashmla, missing_sources, source_dir
from kernels.flashmla.decode import flashmla_decode_fwd, flashmla_unusable, mla_decode_impl, use_flashmla
from tests.kernels.helpers import DEVICE
from tests.kernels.test_mla_decode import _reference, _setup

ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def test_impl_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("TANDEM_MLA_DECODE_IMPL", raising=False)
    assert mla_decode_impl() == "auto"
    monkeypatch.setenv("TANDEM_MLA_DECODE_IMPL", "triton")
    assert mla_decode_impl() == "triton"
    monkeypatch.setenv("TANDEM_MLA_DECODE_IMPL", "flashmla")
    assert mla_decode_impl() == "flashmla"
    monkeypatch.setenv("TANDEM_MLA_DECODE_IMPL", "flash-mla")
    with pytest.raises(ValueError, match="TANDEM_MLA_DECODE_IMPL"):
        mla_decode_impl()


def test_missing_sources_are_named(tmp_path):
    assert len(missing_sources(tmp_path)) == 5
    with pytest.raises(FileNotFoundError, match=r"fetch_sources\.sh"):
        load_flashmla(str(tmp_path))


def test_unusable_caches_say_why():
    cpu = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    assert "not on a CUDA device" in flashmla_unusable(cpu, 32)
    if ON_SM90:
        gpu = cpu.cuda()
        assert flashmla_unusable(gpu, 32) is None
        assert "pages" in flashmla_unusable(gpu[:, :16].contiguous(), 32)
        assert "bf16" in flashmla_unusable(gpu.float(), 32)
        assert "128" in flashmla_unusable(gpu, 256)


def test_auto_takes_flashmla_only_where_it_applies(monkeypatch):
    """Auto: a CPU cache or one in pages of 16 stays on Triton whatever is built; forced modes decide alone."""
    import kernels.flashmla.decode as decode

    monkeypatch.setattr(decode, "_flashmla_loads", lambda: True)  # as if the extension were built
    monkeypatch.delenv("TANDEM_MLA_DECODE_IMPL", raising=False)
    assert not use_flashmla(torch.zeros(2, 64, 576, dtype=torch.bfloat16), 32)
    if ON_SM90:
        cache = torch.zeros(2, 64, 576, dtype=torch.bfloat16, device="cuda")
        assert use_flashmla(cache, 32)
        assert not use_flashmla(cache[:, :16].contiguous(), 32)
    monkeypatch.setattr(decode, "_flashmla_loads", lambda: False)  # not built, not buildable
    assert not use_flashmla(torch.zeros(2, 64, 576, dtype=torch.bfloat16, device=DEVICE), 32)
    monkeypatch.setenv("TANDEM_MLA_DECODE_IMPL", "flashmla")
    assert use_flashmla(torch.zeros(2, 64, 576), 32)  # forced: flashmla_decode_fwd then says why it cannot
    monkeypatch.setenv("TANDEM_MLA_DECODE_IMPL", "triton")
    assert not use_flashmla(torch.zeros(2, 64, 576), 32)


def test_requested_flashmla_never_falls_back_silently(monkeypatch):
    """With TANDEM_MLA_DECODE_IMPL=flashmla a decode launch FlashMLA cannot take raises, naming why, instead of
    quietly running the Triton kernel (an A/B run would otherwise measure the wrong kernel)."""
    import kernels.paged_attention.mla as mla

    h, nope, rope, v, r, page = 4, 16, 8, 16, 32, 4
    ctx = [3, 9]
    _, _, latent, tables, _, _ = _setup(ctx, h, r, rope, page, seed=3)
    q = torch.randn(len(ctx), h, nope + rope).to(latent.device)
    kv_b = torch.randn(h * (nope + v), r).to(latent.device)
    monkeypatch.setenv("TANDEM_MLA_DECODE_IMPL", "flashmla")
    with pytest.raises(ValueError, match="flashmla_decode_fwd"):
        mla.paged_mla_attention_triton(q, latent, [0, 1, 2], ctx, tables, kv_b, r, nope, v, 0.2)


@pytest.mark.skipif(
    not ON_SM90 or bool(missing_sources(source_dir())),
    reason="needs an sm90 GPU and the FlashMLA sources (kernels/flashmla/fetch_sources.sh); CI has neither",
)
def test_matches_reference_on_sm90():
    ctx = [1, 63, 64, 65, 1000, 4097]  # page-unaligned, mixed lengths in one batch
    q_lat, q_pe, latent, tables, bt, ctx_t = _setup(ctx, 32, 512, 64, 64, dtype=torch.bfloat16)
    scale = 192**-0.5
    out = flashmla_decode_fwd(q_lat, q_pe, latent, bt, ctx_t, scale)
    ref = _reference(q_lat, q_pe, latent, tables, ctx, scale)
    assert (out.float().cpu() - ref).abs().max().item() < 2e-2


def test_auto_falls_back_when_the_build_fails(monkeypatch, tmp_path, caplog):
    """Sources present but the build raising (even with an empty message): auto logs why and stays on Triton."""
    import kernels.flashmla.decode as decode

    monkeypatch.delenv("TANDEM_FLASHMLA_SO", raising=False)
    monkeypatch.setattr(decode, "missing_sources", lambda src: [])

    def broken():
        raise RuntimeError()

    monkeypatch.setattr(decode, "load_flashmla", broken)
    decode._flashmla_loads.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=decode.__name__):
            assert decode._flashmla_loads() is False
        assert "RuntimeError" in caplog.text
    finally:
        decode._flashmla_loads.cache_clear()
