"""Parallel building blocks that need no second process: startup guards, the stage partition, the
microbatch split, TP slicing. (Multi-rank runs: test_parallel_{pp,tp,pcp}.py.)"""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch

from decode_svc.config import DecodeConfig
from engine.config import EngineConfig, SpeculativeConfig
from engine.model_config import load_model_config
from engine.parallel.config import ParallelConfig, ParallelLayoutError
from engine.parallel.kda_scan import SCAN_CHUNK, apply_initial_state, linear_segments, scan_states, segment_bounds
from engine.parallel.plan import split_batch
from engine.parallel.tp import TPPlan, TPShard
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk
from kernels.kda.naive import naive_chunk_kda_varlen, naive_recurrent_kda
from prefill_svc.config import PrefillConfig
from tests.conftest import make_engine, random_prompts


# ---- startup guards: every refusal names the layout ---------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(pcp=2, tp=2), "pcp=2 x tp=2"),
        (dict(pp=16), "pp=16: at most 8"),
        (dict(pp=0), "pp=0 must be >= 1"),
        (dict(backend="mpi"), "backend='mpi'"),
    ],
)
def test_layout_guards(kw, match):
    with pytest.raises(ParallelLayoutError, match=match):
        ParallelConfig(**kw)


def test_model_guards(tiny_models):
    kimi, qwen = (load_model_config(tiny_models[a]) for a in ("kimi_linear", "qwen3"))
    with pytest.raises(ParallelLayoutError, match="pp=8: 4 layers cannot fill 8 stages"):
        ParallelConfig(pp=8).check_model(kimi)
    with pytest.raises(ParallelLayoutError, match="tp=4 for KimiLinearForCausalLM: 2 attention heads"):
        ParallelConfig(tp=4).check_model(kimi)
    with pytest.raises(ParallelLayoutError, match="tp=3 for Qwen3ForCausalLM: 4 attention heads"):
        ParallelConfig(tp=3).check_model(qwen)
    ParallelConfig(tp=4).check_model(qwen)  # 2 KV heads, each replicated on two ranks
    ParallelConfig(pcp=8, pp=4).check_model(kimi)


def test_role_and_service_guards():
    with pytest.raises(ParallelLayoutError, match="prefill layout pp=2 x tp=2"):
        PrefillConfig(EngineConfig(model="unused", parallel=ParallelConfig(pp=2, tp=2)))
    with pytest.raises(ParallelLayoutError, match="decode layout pcp=2"):
        DecodeConfig(EngineConfig(model="unused", parallel=ParallelConfig(pcp=2)))
    with pytest.raises(ParallelLayoutError, match="pcp=2 x pp=2 with --enable-prefix-caching"):
        PrefillConfig(EngineConfig(model="unused", enable_prefix_caching=True, parallel=ParallelConfig(pcp=2, pp=2)))
    spec = SpeculativeConfig("ngram", 3)  # decode speculates under TP and PP (test_parallel_speculative.py)
    DecodeConfig(EngineConfig(model="unused", parallel=ParallelConfig(tp=2, pp=2)), speculative=spec)
    PrefillConfig(EngineConfig(model="unused", parallel=ParallelConfig(pcp=8, pp=8)))
    DecodeConfig(EngineConfig(model="unused", parallel=ParallelConfig(tp=4, pp=2)))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["prefill", "--tp", "2"], "unsupported prefill layout tp=2"),
        (["decode", "--pcp", "2", "--pp", "2"], "unsupported decode layout pcp=2 x pp=2"),
        (["generate", "--pp", "8"], "pp=8: 4 layers cannot fill 8 stages"),
        (["generate", "--tp", "2", "--cuda-graphs"], "tp=2 with --cuda-graphs"),
    ],
)
def test_cli_refuses_at_startup(tiny_models, args, match):
    """Refused before any rank starts: exit code 2 and the reason, not a hang."""
    cmd = [sys.executable, "-m", "tandem.cli", args[0], "--model", str(tiny_models["kimi_linear"]), *args[1:]]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert match in r.stderr


# ---- the stage partition --------------------------------------------------------------------------------
@pytest.mark.parametrize("pp", range(1, 9))
def test_stage_layers_are_contiguous_balanced_and_complete(pp):
    for n in range(pp, 20):
        ranges = [ParallelConfig(pp=pp).stage_layers(n, s) for s in range(pp)]
        assert [i for r in ranges for i in r] == list(range(n))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
        assert all(len(r) for r in ranges)


# ---- the microbatch split -------------------------------------------------------------------------------
def _chunks(page_size: int) -> list[ScheduledChunk]:
    """Three requests mid-flight: a decode, a middle prefill chunk with a rung, a first chunk."""
    out = []
    for rid, (prompt, start, n, cks) in enumerate([(40, 40, 1, ()), (150, 48, 48, ((64, 7),)), (30, 0, 30, ())]):
        req = Request(f"r{rid}", random_prompts(1, [prompt], seed=rid)[0], SamplingParams())
        if start == prompt:  # decoding: one generated token so far
            req.output_token_ids.append(5)
        req.page_ids = list(range(rid * 20, rid * 20 + -(-(start + n) // page_size)))
        req.slot_ids = [rid]
        out.append(ScheduledChunk(req, start, n, cks))
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_split_batch_partitions_rows_and_metadata(model_dir, n):
    eng = make_engine(model_dir)
    batch = eng.runner.prepare(_chunks(eng.config.page_size))
    pieces = split_batch(batch, n)
    assert len(pieces) == min(n, batch.num_tokens)
    assert torch.equal(torch.cat([p.input_ids for p in pieces]), batch.input_ids)
    assert torch.equal(torch.cat([p.positions for p in pieces]), batch.positions)
    assert torch.equal(torch.cat([p.slot_mapping for p in pieces]), batch.slot_mapping)
    rows_before = 0
    sampled = []
    for p in pieces:
        for i in range(p.num_seqs):
            start, end = p.context_lens[i] - p.q_len(i), p.context_lens[i]
            assert torch.equal(p.positions[p.query_start_loc[i] : p.query_start_loc[i + 1]], torch.arange(start, end))
            assert p.chunk_starts[i] == start
            assert p.has_initial_state[i] == (start > 0)
            assert all(start < pos <= end for pos, _ in p.checkpoints[i])
        sampled += [rows_before + int(j) for j in p.logits_indices]
        rows_before += p.num_tokens
    assert sampled == batch.logits_indices.tolist()
    assert sorted(ck for p in pieces for cks in p.checkpoints for ck in cks) == [(64, 7)]
    assert sum(c for p in pieces for c in p.completes_prompt) == sum(batch.completes_prompt)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_split_batch_pieces_in_order_give_the_same_logits(model_dir, n):
    """Running the pieces one after another on one rank equals running the whole step: the second part of
    a cut sequence finds its first part's KV and KDA state in place."""
    prompts = random_prompts(3, [50, 23, 70], seed=9)
    outs = []
    for pieces in (1, n):
        eng = make_engine(model_dir)
        reqs = []
        for k, p in enumerate(prompts):
            req = Request(f"r{k}", p, SamplingParams())
            req.page_ids = eng.pages.allocate(-(-len(p) // eng.config.page_size))
            req.slot_ids = eng.slots.allocate(1) if eng.slots is not None else []
            reqs.append(req)
        batch = eng.runner.prepare([ScheduledChunk(r, 0, r.num_tokens) for r in reqs])
        with torch.inference_mode():
            rows = [eng.model(piece, eng.cache)[piece.logits_indices] for piece in split_batch(batch, pieces)]
            outs.append(eng.model.compute_logits(torch.cat(rows)))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-4)


# ---- TP slicing ------------------------------------------------------------------------------------------
def test_tp_kv_heads_split_or_replicate(tiny_models):
    qwen = load_model_config(tiny_models["qwen3"])  # 4 query heads, 2 KV heads
    starts = [(TPPlan(qwen, 4, r, False).kv_start, TPPlan(qwen, 4, r, False).kv_heads) for r in range(4)]
    assert starts == [(0, 1), (0, 1), (1, 1), (1, 1)]  # query head r uses KV head r // 2
    assert [(TPPlan(qwen, 2, r, False).kv_start, TPPlan(qwen, 2, r, False).kv_heads) for r in range(2)] == [
        (0, 1),
        (1, 1),
    ]


def test_tp_state_slices_reassemble_the_canonical_state(tiny_models):
    kimi = load_model_config(tiny_models["kimi_linear"])
    h, k, w = kimi.kda_num_heads, kimi.kda_head_dim, kimi.conv_kernel_size
    rec, conv = torch.randn(h, k, k), torch.randn(3 * h * k, w - 1)
    plans = [TPPlan(kimi, 2, r, False) for r in range(2)]
    assert torch.equal(torch.cat([p.local_recurrent(rec) for p in plans]), rec)
    parts = [p.local_conv(conv).view(3, 1, k, w - 1) for p in plans]  # q|k|v of each rank's head
    assert torch.equal(torch.cat(parts, dim=1).reshape(3 * h * k, w - 1), conv)


def test_tp_shards_of_parameters(tiny_models):
    kimi = load_model_config(tiny_models["kimi_linear"])
    p = TPPlan(kimi, 2, 1, shard_lm_head=True)
    assert p.shard_of("model.layers.3.self_attn.q_proj.weight", (48, 64)) == TPShard(0, 24, 24)
    assert p.shard_of("model.layers.3.self_attn.o_proj.weight", (64, 32)).dim == 1
    assert p.shard_of("model.layers.3.self_attn.kv_a_proj_with_mqa.weight", (40, 64)) is None  # latent replicated
    assert p.shard_of("model.layers.0.self_attn.A_log", (1, 1, 2, 1)).dim == 2
    assert p.shard_of("model.layers.1.block_sparse_moe.experts.w2", (4, 64, 32)).dim == 2
    assert p.shard_of("model.layers.1.block_sparse_moe.gate.weight", (4, 64)) is None  # routing replicated
    assert p.shard_of("lm_head.weight", (512, 64)) == TPShard(0, 256, 256)
    assert p.shard_of("model.norm.weight", (64,)) is None


# ---- the KDA state scan (PCP) ------------------------------------------------------------------------------
@pytest.mark.parametrize("cuts", [[0, 150], [0, 64, 150], [0, 64, 64, 128, 150], [0, 37, 100, 101, 150]])
def test_kda_segments_scanned_equal_the_whole_recurrence(cuts):
    """The first segment from the initial state, the others from a zero state with their linear parts (the
    widened chunk pass), joined by the scan, equal one run: outputs and final state (empty and single-token
    segments included)."""
    gen = torch.Generator().manual_seed(5)
    t, h, k = 150, 2, 16
    q, kk, v = (torch.randn(t, h, k, generator=gen) for _ in range(3))
    v = torch.cat([v, torch.randn(t, h, 8, generator=gen)], dim=-1)  # V != K
    g = -torch.rand(t, h, k, generator=gen) * 0.3
    beta = torch.rand(t, h, generator=gen)
    init = torch.randn(h, k, 24, generator=gen) * 0.5
    o_ref, s_ref = naive_recurrent_kda(q[None], kk[None], v[None], g[None], beta[None], init[None])
    a, b = cuts[0], cuts[1]
    o_first, f_first, _ = naive_chunk_kda_varlen(q[a:b], kk[a:b], v[a:b], g[a:b], beta[a:b], init[None], [0, b - a])
    trans, final0, outs = [torch.zeros(h, k, k)], [f_first[0]], []
    for a, b in itertools.pairwise(cuts[1:]):
        parts = linear_segments(naive_chunk_kda_varlen, q[a:b], kk[a:b], v[a:b], g[a:b], beta[a:b], [0, b - a])
        outs.append(parts[:2])
        trans.append(parts[2][0])
        final0.append(parts[3][0])
    starts = scan_states(init, torch.stack(trans), torch.stack(final0))
    o = torch.cat([o_first] + [apply_initial_state(o0, p, starts[i + 1]) for i, (o0, p) in enumerate(outs)])
    torch.testing.assert_close(o, o_ref[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(starts[-1], s_ref[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("length", [1, 64, 65, 200, 1000, 4096])
@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_segment_bounds_cover_the_chunk_on_chunk_boundaries(length, size):
    bounds = segment_bounds(length, size)
    assert len(bounds) == size and bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert all(lo % SCAN_CHUNK == 0 or lo == length for lo, _ in bounds)
    if (
        length > SCAN_CHUNK
    ):  # the first rank takes the larger share (it runs the narrower pass), up to a chunk of rounding
        assert bounds[0][1] - bounds[0][0] + SCAN_CHUNK >= max(hi - lo for lo, hi in bounds[1:])
    else:
        assert bounds[0] == (0, length)


def test_lm_head_is_sharded_only_under_tp(tiny_models):
    """shard_lm_head is on by default on CUDA; with tp=1 (PCP or PP alone) there is nothing to shard."""
    from engine.parallel.tp import TPPlan

    qwen = load_model_config(tiny_models["qwen3"])
    assert not TPPlan(qwen, 1, 0, shard_lm_head=True).shard_lm_head
    assert TPPlan(qwen, 2, 0, shard_lm_head=True).shard_lm_head


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_local_queries_are_the_rows_and_positions_each_rank_holds(size):
    """The strided-position metadata of the fast PCP attention equals the per-row reference (seq_rows)."""
    from types import SimpleNamespace

    from engine.parallel.pcp import PCPRows, local_queries

    q_lens, ctx = [5, 1, 17, 8, 2, 64], [5, 40, 30, 8, 2, 100]
    qsl = [0, *itertools.accumulate(q_lens)]
    full = SimpleNamespace(query_start_loc=qsl, context_lens=ctx)
    for rank in range(size):
        rows = PCPRows(SimpleNamespace(inner_size=size, inner_rank=rank, device=torch.device("cpu")), qsl[-1])
        lq = local_queries(full, rows)
        assert lq.num_rows == int((rows.index < qsl[-1]).sum())
        for i in range(len(q_lens)):
            local, pos = rows.seq_rows(qsl[i], qsl[i + 1], ctx[i])
            assert local.tolist() == list(range(lq.qsl[i], lq.qsl[i + 1]))
            assert pos.tolist() == [lq.pos0[i] + j * size for j in range(local.numel())]


def _route(plans, exchange: str, layouts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run one RowExchange of every simulated rank: what each rank would receive and place."""
    size = len(plans)
    sent = [getattr(p, exchange) for p in plans]
    chunks = [list(layouts[s][sent[s].send_index].split(sent[s].send_counts)) for s in range(size)]
    outs = []
    for d in range(size):
        ex = sent[d]
        received = torch.cat([chunks[s][d] for s in range(size)])
        assert [chunks[s][d].shape[0] for s in range(size)] == ex.recv_counts
        out = torch.full((ex.out_rows,), -1, dtype=torch.int64)
        out[ex.recv_index] = received
        outs.append(out)
    return outs


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_segment_plan_moves_every_row_to_its_segment_and_back(size):
    """Row layout -> segment layout (halo rows included) -> row layout, simulated for every rank with each
    row's global index as its value."""
    from types import SimpleNamespace

    from engine.parallel.pcp_segments import HALO, plan_segments

    q_lens = [700, 1, 64, 65, 300, 2000]
    qsl = [0, *itertools.accumulate(q_lens)]
    t = qsl[-1]
    full = SimpleNamespace(
        query_start_loc=qsl, num_tokens=t, num_seqs=len(q_lens), q_len=lambda i: q_lens[i], state_slots=[]
    )
    local_rows = -(-t // size)
    plans = [plan_segments(full, size, r, local_rows, torch.device("cpu")) for r in range(size)]
    rows = [
        torch.cat([torch.arange(r, t, size), torch.full((local_rows - len(range(r, t, size)),), -1)])
        for r in range(size)
    ]
    segs = _route(plans, "to_segments", rows)
    covered = []
    for r, (p, seg) in enumerate(zip(plans, segs, strict=True)):
        for j, i in enumerate(p.seqs):
            lo, hi = p.bounds[i][r]
            part = seg[p.seg_qsl[j] : p.seg_qsl[j + 1]]
            assert part.tolist() == list(range(lo - p.seg_halo[j], hi))
            assert p.seg_halo[j] == (0 if lo == qsl[i] else HALO)
        covered += seg[p.core].tolist()
    assert sorted(covered) == list(range(t))  # every row in exactly one segment's core
    back = _route(plans, "to_rows", segs)
    for r in range(size):
        real = len(range(r, t, size))
        assert back[r][:real].tolist() == list(range(r, t, size))
        assert back[r][real:].tolist() == [-1] * (local_rows - real)  # padding: nobody sends it


def test_tp_reductions_keep_the_next_norm_out_of_the_blocks(tiny_models):
    """Under TP a block's output is a partial sum until its all-reduce hook: no layer may run the norm after it
    inside the block (``CausalLM._norm_after`` gives None once the reductions are installed); tp=1 installs none."""
    from engine.models.registry import build_model

    cfg = load_model_config(tiny_models["kimi_linear"])
    for tp, fused in ((1, True), (2, False)):
        model = build_model(cfg)
        assert model._norm_after(0) is model.layers[1].input_layernorm
        TPPlan(cfg, tp, 0, False).install_reductions(model, groups=None)
        assert model.fuse_next_norm is fused
        assert (model._norm_after(len(model.layers) - 1) is model.model.norm) is fused
