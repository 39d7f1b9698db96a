"""kernels/flashmla/plan.py: the Triton planner equals its naive contract exactly; both it and a transcription of
FlashMLA's own planner pass a checker of what FlashMLA's kernels assume of a plan (and the checker fails on broken
plans); flashmla_decode_fwd hands the plan to the extension. On sm90 with the FlashMLA sources: FlashMLA's planner
equals the transcription, and its kernel with our plans matches the fp32 reference, eagerly and in a CUDA graph."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.flashmla.build import missing_sources, source_dir
from kernels.flashmla.naive_plan import (
    END_BLOCK,
    FIRST_SPLIT,
    combine_max_splits,
    flashmla_reference_plan,
    naive_plan,
    plan_errors,
)
from tests.kernels.helpers import DEVICE, ON_CUDA
from tests.kernels.test_mla_decode import _reference, _setup

ON_SM90 = ON_CUDA and torch.cuda.get_device_capability() == (9, 0)
needs_flashmla = pytest.mark.skipif(
    not ON_SM90 or bool(missing_sources(source_dir())),
    reason="needs an sm90 GPU and the FlashMLA sources (kernels/flashmla/fetch_sources.sh); CI has neither",
)
GRID = 132  # the H200's parts at 32 heads


def _ragged(b: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice((0, 1, 63, 64, 65, rng.randint(0, hi))) for _ in range(b)]


LENGTHS = {
    "one_4k": [4096],
    "one_empty": [0],
    "one_token": [1],
    "edges": [0, 1, 63, 64, 65, 4096],
    "all_empty": [0] * 5,
    "equal_16x4k": [4096] * 16,
    "equal_64x32k": [32768] * 64,
    "ragged_7": _ragged(7, 5000, 1),
    "ragged_40": _ragged(40, 40000, 2),
    "ragged_100": _ragged(100, 3000, 3),  # several request chunks of the kernel: carried prefix sums
    "ragged_300": _ragged(300, 700, 4),  # more requests than parts' blocks at small part counts
}
PARTS = (1, 2, 3, 7, 8, 16, 33, 64, 66, 100, 131, 132)


@pytest.fixture(scope="module")
def plan():
    """The planner module, imported while the package fixture holds TRITON_INTERPRET=1 on a CPU machine: its
    kernel picks the interpreter when it is defined (it is not among conftest's TRITON_MODULES)."""
    from kernels.flashmla import plan as mod

    if not ON_CUDA:
        from triton.runtime.interpreter import InterpretedFunction

        assert isinstance(mod._even_blocks_plan_kernel, InterpretedFunction), "plan.py was imported uncompiled"
    return mod


def _lens(name: str) -> torch.Tensor:
    return torch.tensor(LENGTHS[name], dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("name", LENGTHS)
def test_triton_plan_equals_naive_plan(plan, name):
    lens = _lens(name)
    for grid in (GRID, 66, 8):
        for parts in [p for p in PARTS if p <= grid] + [grid]:
            meta, splits = plan.even_blocks_plan(lens, parts, grid)
            ref_meta, ref_splits = naive_plan(LENGTHS[name], parts, grid)
            assert torch.equal(meta.cpu(), ref_meta), f"{name}, {parts}/{grid} parts: meta differs"
            assert torch.equal(splits.cpu(), ref_splits), f"{name}, {parts}/{grid} parts: num_splits differs"
            assert plan_errors(ref_meta, ref_splits, LENGTHS[name], grid) == []


def test_triton_plan_equals_naive_plan_at_random(plan):
    rng = random.Random(7)
    for _ in range(40):
        lens = _ragged(rng.randint(1, 80), rng.choice((64, 4096, 40000)), rng.randint(0, 1 << 30))
        parts = rng.randint(1, GRID)
        meta, splits = plan.even_blocks_plan(torch.tensor(lens, dtype=torch.int32, device=DEVICE), parts, GRID)
        ref_meta, ref_splits = naive_plan(lens, parts, GRID)
        assert torch.equal(meta.cpu(), ref_meta) and torch.equal(splits.cpu(), ref_splits), (lens, parts)


@pytest.mark.parametrize("name", LENGTHS)
def test_min_blocks_caps_the_parts_by_the_lengths(plan, name):
    """min_blocks: every part takes at least that many blocks, so short contexts use fewer of the parts (chosen
    on the device from the lengths); the Triton plan equals the reference's, and both are valid coverings."""
    lens, blocks = _lens(name), sum(max(1, -(-max(n, 0) // 64)) for n in LENGTHS[name])
    for min_blocks in (2, 8, 64):
        meta, splits = plan.even_blocks_plan(lens, GRID, GRID, min_blocks)
        ref_meta, ref_splits = naive_plan(LENGTHS[name], GRID, GRID, min_blocks)
        assert torch.equal(meta.cpu(), ref_meta) and torch.equal(splits.cpu(), ref_splits), (name, min_blocks)
        assert plan_errors(ref_meta, ref_splits, LENGTHS[name], GRID) == []
        used = int((ref_meta[:, 0] < len(LENGTHS[name])).sum())
        assert used == -(-blocks // max(-(-blocks // GRID), min_blocks))
    with pytest.raises(ValueError, match="min_blocks"):
        plan.even_blocks_plan(lens, GRID, GRID, 0)


@pytest.mark.parametrize("name", LENGTHS)
def test_plans_are_valid_coverings(name):
    """Our policy and FlashMLA's planner (transcribed) in the same format, both passing the checker."""
    for grid in (GRID, 66):
        assert plan_errors(*flashmla_reference_plan(LENGTHS[name], grid), LENGTHS[name], grid) == []
        for parts in (1, 5, grid):
            meta, splits = naive_plan(LENGTHS[name], parts, grid)
            assert plan_errors(meta, splits, LENGTHS[name], grid) == []
            counts = (splits[1:] - splits[:-1]).tolist()
            assert max(counts) <= parts <= combine_max_splits(grid)  # so never over the combine's MAX_SPLITS
            assert int((meta[:, 0] < len(LENGTHS[name])).sum()) <= parts


def test_flashmla_planner_transcription_splits_a_4k_context_into_64_one_page_splits():
    """What the planner replaces: at batch 1 FlashMLA gives each of 64 parts one page (and a 64-way combine)."""
    meta, splits = flashmla_reference_plan([4096], GRID)
    assert splits.tolist() == [0, 64]
    assert (meta[:64, END_BLOCK] - meta[:64, 2]).tolist() == [1] * 64 and (meta[64:, 0] == 1).all()
    meta, splits = naive_plan([4096], 8, GRID)
    assert splits.tolist() == [0, 8] and (meta[:8, END_BLOCK] - meta[:8, 2]).tolist() == [8] * 8


def _corrupt(kind: str, meta: torch.Tensor, splits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    meta, splits = meta.clone(), splits.clone()
    if kind == "block_dropped":
        meta[0, END_BLOCK] -= 1
    elif kind == "block_twice":
        meta[1, 2] -= 1
    elif kind == "split_index":
        meta[1, 4] += 1
    elif kind == "flag":
        meta[0, FIRST_SPLIT] ^= 1
    elif kind == "one_request_two_flags":
        meta[0, FIRST_SPLIT], meta[0, FIRST_SPLIT + 1] = 1, 0
    elif kind == "num_splits":
        splits[1:] += 1
    elif kind == "requests_reversed":
        begin, end = meta[1, :2].tolist()
        meta[1, 0], meta[1, 1] = end + 1, begin
    elif kind == "empty_part_start":
        meta[-1, 0] += 1
    elif kind == "too_many_splits":
        splits[1:] += combine_max_splits(GRID)
    return meta, splits


CORRUPTIONS = {
    "block_dropped": "range",
    "block_twice": "range",
    "split_index": "split index",
    "flag": "accumulators",
    "one_request_two_flags": "flags",
    "num_splits": "num_splits says",
    "requests_reversed": "out of order",
    "empty_part_start": "empty with begin_req",
    "too_many_splits": "MAX_SPLITS",
}


@pytest.mark.parametrize("kind", CORRUPTIONS)
@pytest.mark.parametrize("planner", ["ours", "flashmla"])
def test_checker_fails_on_a_corrupted_plan(kind, planner):
    lens = [4096, 100, 0, 300]
    meta, splits = naive_plan(lens, 16, GRID) if planner == "ours" else flashmla_reference_plan(lens, GRID)
    assert meta[0, 0] == meta[0, 1] == 0 and meta[0, FIRST_SPLIT] == 1  # part 0 holds a piece of request 0 only
    errs = plan_errors(*_corrupt(kind, meta, splits), lens, GRID)
    assert any(CORRUPTIONS[kind] in e for e in errs), errs


def test_auto_policy(plan, monkeypatch):
    """auto: every part of the grid, at most AUTO_MAX_PARTS_PER_SEQ a sequence, each part taking at least
    AUTO_MIN_BLOCKS blocks, so the parts used follow the lengths (a 4k context at batch 1: 16 parts of 4 pages, not
    FlashMLA's 64 of one; a 32k one: 64 parts of 8, not 128 of 4)."""
    monkeypatch.delenv(plan.PARTS_ENV, raising=False)
    monkeypatch.delenv(plan.MIN_BLOCKS_ENV, raising=False)
    monkeypatch.delenv(plan.MAX_PARTS_PER_SEQ_ENV, raising=False)
    assert plan.AUTO_MAX_PARTS_PER_SEQ == plan.max_parts_per_seq_setting() == 64
    assert [plan.num_parts_for(b, GRID) for b in (1, 2, 3, 16, 64, 512)] == [64, 128] + [GRID] * 4
    assert plan.num_parts_for(64, 66) == 66 and plan.num_parts_for(1, 4) == 4  # the grid's parts, whatever it is
    meta, _ = plan.even_blocks_plan(torch.tensor([32768], dtype=torch.int32, device=DEVICE), 64, GRID, 4)
    assert int((meta[:, 0] < 1).sum()) == 64  # 512 blocks: 64 parts of 8
    monkeypatch.setenv(plan.MAX_PARTS_PER_SEQ_ENV, "200")
    assert plan.num_parts_for(1, GRID) == GRID
    monkeypatch.setenv(plan.MAX_PARTS_PER_SEQ_ENV, "0")
    with pytest.raises(ValueError, match=plan.MAX_PARTS_PER_SEQ_ENV):
        plan.num_parts_for(1, GRID)
    assert combine_max_splits(GRID) >= GRID and plan.AUTO_MIN_BLOCKS == plan.min_blocks_setting() == 4
    meta, _ = plan.even_blocks_plan(torch.tensor([4096], dtype=torch.int32, device=DEVICE), GRID, GRID, 4)
    assert int((meta[:, 0] < 1).sum()) == 16


def test_planner_rejects_bad_arguments(plan):
    lens = torch.tensor([5, 6], dtype=torch.int32, device=DEVICE)
    for parts, grid in ((0, GRID), (GRID + 1, GRID), (161, 161)):
        with pytest.raises(ValueError):
            plan.even_blocks_plan(lens, parts, grid)
    with pytest.raises(ValueError, match="int32"):
        plan.even_blocks_plan(lens.long(), 4, GRID)
    with pytest.raises(ValueError, match="non-empty"):
        plan.even_blocks_plan(lens[:0], 4, GRID)


def test_decode_hands_the_plan_to_flashmla(plan, monkeypatch):
    """flashmla_decode_fwd with the extension faked (runs anywhere): the policy's plan goes in as
    tile_scheduler_metadata / num_splits; ``flashmla`` passes none (FlashMLA plans); a DecodeSchedule's other
    layers reuse the first layer's plan; num_parts overrides the policy."""
    import kernels.flashmla.decode as decode

    seen: list[tuple] = []

    class Fake:
        def dense_decode_fwd(self, q, kcache, dv, lens, bt, scale, causal, meta, splits):
            seen.append((meta, splits))
            if meta is None:
                meta, splits = flashmla_reference_plan(lens.tolist(), GRID)
            return torch.zeros(q.shape[0], q.shape[2], 1, dv, dtype=q.dtype), None, meta, splits

    monkeypatch.setattr(decode, "load_flashmla", Fake)
    monkeypatch.setattr(decode, "flashmla_unusable", lambda cache, heads: None)
    monkeypatch.setattr(plan, "flashmla_grid_parts", lambda device, heads: GRID)
    monkeypatch.delenv(plan.PARTS_ENV, raising=False)
    ctx = [70, 4096, 1]
    q_lat, q_pe, latent, _, bt, ctx_t = _setup(ctx, 32, 512, 64, 64, dtype=torch.bfloat16)

    def call(**kw):
        decode.flashmla_decode_fwd(q_lat, q_pe, latent, bt, ctx_t, 0.1, **kw)
        return seen[-1]

    meta, splits = call()
    want = naive_plan(ctx, plan.num_parts_for(len(ctx), GRID), GRID, plan.min_blocks_setting())
    assert torch.equal(meta.cpu(), want[0]) and torch.equal(splits.cpu(), want[1])
    meta, _ = call(num_parts=5)
    assert torch.equal(meta.cpu(), naive_plan(ctx, 5, GRID, plan.min_blocks_setting())[0])
    sched = decode.DecodeSchedule()
    first = call(schedule=sched)
    latent_b = latent.clone()  # another layer: another cache
    decode.flashmla_decode_fwd(q_lat, q_pe, latent_b, bt, ctx_t, 0.1, schedule=sched)
    assert seen[-1][0] is first[0] and seen[-1][1] is first[1]
    monkeypatch.setenv(plan.PARTS_ENV, "flashmla")
    assert call() == (None, None)
    assert call(num_parts=3)[0] is not None  # an explicit count wins (the benchmark's sweep)


@needs_flashmla
@pytest.mark.parametrize("name", ["one_4k", "edges", "ragged_40", "equal_16x4k", "ragged_300"])
def test_flashmla_planner_equals_its_transcription_on_sm90(name):
    """The extension without a plan returns its own: the transcription must reproduce it (empty parts: only their
    requests, FlashMLA leaves shared-memory junk in their begin_block)."""
    from kernels.flashmla.build import load_flashmla

    lens = LENGTHS[name]
    q_lat, q_pe, latent, _, bt, _ = _setup(lens, 32, 512, 64, 64, dtype=torch.bfloat16)
    q = torch.cat([q_lat, q_pe], -1).unsqueeze(1)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    _, _, meta, splits = load_flashmla().dense_decode_fwd(
        q, latent.unsqueeze(2), 512, lens_t, bt, 0.1, False, None, None
    )
    grid = meta.shape[0]
    ref_meta, ref_splits = flashmla_reference_plan(lens, grid)
    meta, live = meta.cpu(), ref_meta[:, 0] < len(lens)
    assert torch.equal(splits.cpu(), ref_splits)
    assert torch.equal(meta[live, :7], ref_meta[live, :7])
    assert torch.equal(meta[~live, :2], ref_meta[~live, :2])


def _check(out: torch.Tensor, q_lat, q_pe, latent, tables, lens, scale, what: str) -> None:
    ref = _reference(q_lat, q_pe, latent, tables, lens, scale)
    err = (out.float().cpu() - ref).abs().max().item()
    assert err < 2e-2, f"{what}, lengths {lens}: max error {err:.3g}"


@needs_flashmla
@pytest.mark.parametrize("ctx", [[1, 63, 64, 65, 1000, 4097], [0, 5, 4097], [4096], [2000] * 20 + [1, 129, 0]])
def test_our_plans_match_reference_on_sm90(plan, ctx, monkeypatch):
    """FlashMLA's kernel with our plan at several part counts (and the policy's) against the fp32 reference and
    against FlashMLA with its own plan (bf16 rounding apart)."""
    from kernels.flashmla.decode import flashmla_decode_fwd

    q_lat, q_pe, latent, tables, bt, ctx_t = _setup(ctx, 32, 512, 64, 64, dtype=torch.bfloat16)
    scale = 192**-0.5
    monkeypatch.setenv(plan.PARTS_ENV, "flashmla")
    own = flashmla_decode_fwd(q_lat, q_pe, latent, bt, ctx_t, scale)
    monkeypatch.setenv(plan.PARTS_ENV, "auto")
    for parts in (1, 3, 8, 32, 66, 131, 132, None):
        out = flashmla_decode_fwd(q_lat, q_pe, latent, bt, ctx_t, scale, num_parts=parts)
        _check(out, q_lat, q_pe, latent, tables, ctx, scale, f"{parts} parts")
        assert (out.float() - own.float()).abs().max().item() < 2e-2


@needs_flashmla
@pytest.mark.parametrize("parts", [None, 5, 132])
def test_our_plan_inside_a_cuda_graph_on_sm90(plan, parts, monkeypatch):
    """Captured once, replayed with other lengths (longer, shorter, empty): the graph's planning kernel plans for
    the new lengths (its outputs equal the naive plan) and the output matches the reference each time."""
    from kernels.flashmla.decode import flashmla_decode_fwd

    q_lat, q_pe, latent, tables, bt, ctx_t = _setup([4097] * 4, 32, 512, 64, 64, dtype=torch.bfloat16)
    scale = 192**-0.5
    grid = plan.flashmla_grid_parts(ctx_t.device, 32)
    used = parts or plan.num_parts_for(4, grid)
    captured = {}
    real = plan.even_blocks_plan

    def keep(lens, num_parts, grid_parts, min_blocks=1):
        captured["plan"] = real(lens, num_parts, grid_parts, min_blocks)
        return captured["plan"]

    monkeypatch.setattr(plan, "even_blocks_plan", keep)
    monkeypatch.setenv(plan.PARTS_ENV, "auto")
    ctx_t.copy_(torch.tensor([5, 300, 1000, 64], dtype=torch.int32))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flashmla_decode_fwd(q_lat, q_pe, latent, bt, ctx_t, scale, num_parts=parts)  # compiles, warms up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashmla_decode_fwd(q_lat, q_pe, latent, bt, ctx_t, scale, num_parts=parts)
    meta, splits = captured["plan"]
    for lens in ([5, 300, 1000, 64], [4097, 1, 2048, 65], [0, 4097, 4097, 3]):
        ctx_t.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = naive_plan(lens, used, grid, plan.min_blocks_setting())
        assert torch.equal(meta.cpu(), want[0]) and torch.equal(splits.cpu(), want[1]), lens
        _check(out, q_lat, q_pe, latent, tables, lens, scale, f"graph, {used} parts")
