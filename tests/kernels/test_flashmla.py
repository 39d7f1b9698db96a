"""kernels/flashmla: the selection and error paths everywhere; the kernel itself against the fp32 reference
on an sm90 GPU with the pinned sources present (bench/flashmla_check.py covers real shapes there)."""

from __future__ import annotations

import pytest
import torch

from kernels.flashmla.build import load_flashmla, missing_sources, source_dir
from kernels.flashmla.decode import (
    DecodeSchedule,
    flashmla_decode_fwd,
    flashmla_unusable,
    mla_decode_impl,
    use_flashmla,
)
from tests.kernels.helpers import DEVICE, assert_close, tol
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


def test_parts_policy_comes_from_the_environment(monkeypatch):
    """TANDEM_FLASHMLA_PARTS: auto (the default: the grid's parts, AUTO_MIN_BLOCKS a part), flashmla (FlashMLA plans: no
    count), or a forced count (at most the grid's parts); anything else raises, naming the variable."""
    from kernels.flashmla import plan  # here, not above: its Triton kernel must be defined under the interpreter

    monkeypatch.delenv("TANDEM_FLASHMLA_PARTS", raising=False)
    monkeypatch.delenv("TANDEM_FLASHMLA_MAX_PARTS_PER_SEQ", raising=False)
    assert plan.parts_setting() == "auto" and plan.num_parts_for(3, 132) == 132 and plan.num_parts_for(1, 132) == 64
    monkeypatch.setenv("TANDEM_FLASHMLA_PARTS", "flashmla")
    assert plan.parts_setting() == "flashmla" and plan.num_parts_for(64, 132) is None
    monkeypatch.setenv("TANDEM_FLASHMLA_PARTS", "12")
    assert plan.parts_setting() == 12 and plan.num_parts_for(1, 132) == plan.num_parts_for(64, 132) == 12
    with pytest.raises(ValueError, match="TANDEM_FLASHMLA_PARTS=12"):
        plan.num_parts_for(1, 8)  # more parts than this GPU's grid
    for bad in ("0", "-3", "many", "", "1.5", "FlashMLA"):
        monkeypatch.setenv("TANDEM_FLASHMLA_PARTS", bad)
        with pytest.raises(ValueError, match="TANDEM_FLASHMLA_PARTS"):
            plan.parts_setting()
    monkeypatch.delenv("TANDEM_FLASHMLA_MIN_BLOCKS", raising=False)
    assert plan.min_blocks_setting() == plan.AUTO_MIN_BLOCKS
    monkeypatch.setenv("TANDEM_FLASHMLA_MIN_BLOCKS", "4")
    assert plan.min_blocks_setting() == 4
    for bad in ("0", "x", ""):
        monkeypatch.setenv("TANDEM_FLASHMLA_MIN_BLOCKS", bad)
        with pytest.raises(ValueError, match="TANDEM_FLASHMLA_MIN_BLOCKS"):
            plan.min_blocks_setting()


def test_missing_sources_are_named(tmp_path):
    assert len(missing_sources(tmp_path)) == 5
    with pytest.raises(FileNotFoundError, match=r"fetch_sources\.sh"):
        load_flashmla(str(tmp_path))


def test_the_build_command_builds_even_with_a_prebuilt_path_exported(monkeypatch, tmp_path):
    """``python -m kernels.flashmla.build`` with TANDEM_FLASHMLA_SO pointing where the build is meant to land: it
    goes to the sources (here missing: named), never imports the path."""
    from kernels.flashmla import build

    monkeypatch.setenv("TANDEM_FLASHMLA_SO", str(tmp_path / "not_built_yet.so"))
    monkeypatch.setenv("TANDEM_FLASHMLA_SRC", str(tmp_path / "src"))
    build.load_flashmla.cache_clear()
    try:
        with pytest.raises(FileNotFoundError, match="FlashMLA sources not found"):
            build.main(["--build-dir", str(tmp_path / "out")])
    finally:
        build.load_flashmla.cache_clear()


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


def test_schedule_is_planned_by_the_first_layer_of_every_pass():
    """The first layer to ask plans; other layers reuse its plan; the planner asking again (a new pass over the
    same batch: a graph's warm-up, then its capture) plans again, and the others then take the new plan."""
    sched = DecodeSchedule()
    assert sched.take(owner=1) is None  # layer 1 plans
    first = (torch.zeros(2), torch.zeros(3))
    sched.plan = first
    assert sched.take(owner=2) is first and sched.take(owner=3) is first
    assert sched.take(owner=1) is None and sched.plan is None  # the next pass: layer 1 plans again
    second = (torch.ones(2), torch.ones(3))
    sched.plan = second
    assert sched.take(owner=2) is second


def test_mla_absorbed_hands_flashmla_one_schedule_per_step_and_its_query_buffer(monkeypatch):
    """mla.py's FlashMLA branch (the kernel replaced by the Triton reference so it runs anywhere): the query
    buffer holds q_nope . W_UK and q_pe in FlashMLA's [T, H, 576] layout; two layers of one step share one
    DecodeSchedule, a new step's dict gives a new one; the result equals the Triton branch's."""
    import kernels.paged_attention.mla as mla
    from kernels.paged_attention.meta import build_attn_meta

    h, nope, rope, v, r, page = 4, 16, 64, 16, 512, 64
    ctx = [3, 70, 129]
    _, _, latent, _, bt, _ = _setup(ctx, h, r, rope, page, seed=5)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(len(ctx), h, nope + rope, generator=g).to(DEVICE)
    kv_b = (torch.randn(h * (nope + v), r, generator=g) * r**-0.5).to(DEVICE)
    meta = build_attn_meta([1] * len(ctx), ctx, h, 16, DEVICE, block_tables=bt)
    seen = []

    def fake(q_lat, q_pe, cache, block_tables, ctx_lens, scale, out=None, schedule=None, q=None):
        seen.append((schedule, q.clone()))
        return mla.mla_decode_fwd(q_lat, q_pe, cache, block_tables, ctx_lens, max(ctx), scale)

    monkeypatch.setattr(mla, "use_flashmla", lambda cache, heads: True)
    monkeypatch.setattr(mla, "flashmla_decode_fwd", fake)
    args = (kv_b, r, nope, v, 0.1)
    step = {}
    out = mla.mla_absorbed(q, latent, meta, *args, schedules=step)
    mla.mla_absorbed(q, latent.clone(), meta, *args, schedules=step)  # the step's second MLA layer
    mla.mla_absorbed(q, latent, meta, *args, schedules={})  # the next step
    assert isinstance(seen[0][0], DecodeSchedule) and seen[1][0] is seen[0][0] and seen[2][0] is not seen[0][0]
    w_uk = kv_b.view(h, nope + v, r)[:, :nope]
    q_lat = torch.einsum("thn,hnr->thr", q[..., :nope], w_uk)
    buf = seen[0][1]
    assert buf.shape == (len(ctx), h, r + rope)
    assert_close("q_lat slice", q_lat, buf[..., :r], tol(torch.float32))
    assert torch.equal(buf[..., r:], q[..., nope:])
    monkeypatch.setattr(mla, "use_flashmla", lambda cache, heads: False)
    assert_close("vs the Triton branch", mla.mla_absorbed(q, latent, meta, *args), out, tol(torch.float32))


@pytest.mark.skipif(
    not ON_SM90 or bool(missing_sources(source_dir())),
    reason="needs an sm90 GPU and the FlashMLA sources (kernels/flashmla/fetch_sources.sh); CI has neither",
)
def test_shared_schedule_and_query_buffer_inside_a_cuda_graph_on_sm90():
    """Two layers sharing one DecodeSchedule, their queries in FlashMLA's buffer, captured as one CUDA graph
    after a warm-up pass over the same buffers; replayed with other lengths, each layer still equals the fp32
    reference: the capture holds its own planning kernel (the warm-up's plan is not baked in)."""
    ctx0 = [5, 300, 1000, 64]
    q_lat, q_pe, lat_a, tables, bt, ctx_t = _setup([4097] * 4, 32, 512, 64, 64, dtype=torch.bfloat16)
    lat_b = lat_a.roll(1, dims=0).contiguous()  # a second layer's cache: the same pages, other contents
    q = torch.cat([q_lat, q_pe], dim=-1).contiguous()
    scale = 192**-0.5
    ctx_t.copy_(torch.tensor(ctx0, dtype=torch.int32))

    def step(schedules: dict) -> tuple[torch.Tensor, torch.Tensor]:
        outs = []
        for lat in (lat_a, lat_b):
            sched = schedules.setdefault("s", DecodeSchedule())
            outs.append(flashmla_decode_fwd(q[..., :512], q[..., 512:], lat, bt, ctx_t, scale, schedule=sched, q=q))
        return outs[0], outs[1]

    schedules: dict = {}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(schedules)  # warm-up: plans for ctx0
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_a, out_b = step(schedules)
    for lens in (ctx0, [4097, 1, 2048, 65]):
        ctx_t.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        for name, lat, out in (("layer a", lat_a, out_a), ("layer b", lat_b, out_b)):
            ref = _reference(q_lat, q_pe, lat, tables, lens, scale)
            err = (out.float().cpu() - ref).abs().max().item()
            assert err < 2e-2, f"{name}, lengths {lens}: max error {err:.3g}"
