"""Overlapped decode (EngineConfig.async_scheduling, engine/overlap.py) vs the sequential engine.

On the host every launch runs eagerly, so these tests check the logic that the GPU overlaps: carried input
ids (gathered from the previous step's argmax), continuation vs drain, requests that stop by length (left
out of the next step) or on a stop token (one extra row, dropped), arrivals and aborts between steps, and
that no page or slot is left held.
"""

from __future__ import annotations

import pytest

from engine.decode_graph.graphs import context_bucket
from engine.sampling_params import SamplingParams
from tests.conftest import make_engine, random_prompts

LENGTHS = [5, 17, 33, 40, 9, 64, 23]


def _engine(model_dir, overlap: bool, **kw):
    return make_engine(model_dir, max_num_seqs=8, cuda_graphs=overlap, async_scheduling=overlap, **kw)


def _run(model_dir, prompts, params, overlap: bool, **kw):
    eng = _engine(model_dir, overlap, **kw)
    outs = eng.generate(prompts, params)
    return [(o.output_token_ids, o.finish_reason) for o in outs], eng


def _assert_nothing_held(eng) -> None:
    assert not eng.has_unfinished_requests()
    held_pages = 1 if eng.runner.decode_graphs is not None else 0  # the padding rows' scratch page
    assert eng.pages.num_free == eng.pages.capacity - held_pages
    if eng.slots is not None:
        assert eng.slots.num_free == eng.slots.capacity - held_pages


def test_overlapped_decode_is_token_identical(model_dir):
    prompts = random_prompts(7, LENGTHS)
    max_tokens = (30, 3, 25, 1, 12, 30, 2)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    ref, _ = _run(model_dir, prompts, params, overlap=False)
    got, eng = _run(model_dir, prompts, params, overlap=True)
    assert got == ref
    counts = eng.overlap.counts
    assert counts["continued"] > 15, counts  # steps really were launched behind a step in flight
    # every decode row ran overlapped, and none past a length stop (known before the next launch)
    assert counts["rows"] == sum(m - 1 for m in max_tokens), counts
    _assert_nothing_held(eng)


def test_captures_between_overlapped_steps_keep_the_carried_ids(model_dir):
    """On CUDA a new (batch size, context bucket) is captured while the previous step is in flight: fill with
    padding, two warm-up passes, the capture. The next step carries its input ids from the in-flight step's
    greedy ids, so the warm-ups must not write them. The host does not capture: run the same padding fill and
    warm-ups (DecodeGraphs._warm_up) at each first sighting, as _capture does, and compare tokens."""
    prompts = random_prompts(5, [5, 9, 12, 20, 3])  # contexts cross buckets, the batch shrinks: new graphs
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (40, 6, 30, 15, 60)]
    ref, _ = _run(model_dir, prompts, params, overlap=False)
    eng = _engine(model_dir, True)
    graphs = eng.runner.decode_graphs
    run, seen = graphs.run, set()

    def capturing_run(chunks, carried=None):
        bs = next(s for s in graphs.batch_sizes if s >= len(chunks))
        bucket = context_bucket(max(c.start + 1 for c in chunks), graphs.page_size, graphs.max_context)
        if (bs, bucket) not in seen:
            seen.add((bs, bucket))
            host = graphs.buffers.fill([], bs, bucket)  # _padding_batch, with the host lists the CPU backends read
            graphs._warm_up(graphs.buffers.batch(graphs.buffers.meta(bs, bucket), host))
        return run(chunks, carried)

    graphs.run = capturing_run
    got = [(o.output_token_ids, o.finish_reason) for o in eng.generate(prompts, params)]
    assert len(seen) >= 3 and eng.overlap.counts["continued"] > 15  # captures came between continued steps
    assert got == ref
    _assert_nothing_held(eng)


def test_stop_tokens_mid_run(model_dir):
    """A request that stops on a token at step N already has a row in step N+1: dropped, nothing leaks."""
    prompts = random_prompts(5, LENGTHS, seed=3)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref, _ = _run(model_dir, prompts, greedy, overlap=False)
    # stop each request on a token it emits part-way (the first token seen after its 4th output)
    stops = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[o[4 + i]])
        for i, (o, _) in enumerate(ref)
    ]
    want, _ = _run(model_dir, prompts, stops, overlap=False)
    assert any(len(o) < 24 for o, _ in want)
    got, eng = _run(model_dir, prompts, stops, overlap=True)
    assert got == want
    assert [r for _, r in got].count("stop") >= 3
    # rows computed past a stop token (launched before the token was read) were dropped
    assert eng.overlap.counts["rows"] > sum(len(o) - 1 for o, _ in want)
    _assert_nothing_held(eng)


def test_arrivals_and_aborts_between_steps(model_dir):
    """New requests drain the overlap (they are scheduled as usual); an abort between steps frees its
    request while its next row is in flight; the others' tokens are unchanged."""
    prompts = random_prompts(6, LENGTHS, seed=5)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ref, _ = _run(model_dir, prompts, greedy, overlap=False)
    eng = _engine(model_dir, True)
    ids = [eng.add_request(p, greedy) for p in prompts[:3]]
    done = {}
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
        if steps == 6:
            ids += [eng.add_request(p, greedy) for p in prompts[3:]]
        if steps == 9:
            eng.abort_request(ids[1])
    assert ids[1] not in done  # an aborted request gets no further outputs
    for i, rid in enumerate(ids):
        if i != 1:
            assert done[rid].output_token_ids == ref[i][0], i
    assert eng.overlap.counts["drained"] >= 1 and eng.overlap.counts["continued"] > 5
    _assert_nothing_held(eng)


def _import(consumer, producer, prompt, params) -> str:
    """A P/D import: `producer` prefills the prompt, its pages and state are copied into a reservation of
    `consumer`, which continues from the producer's first token (what DecodeService does over gRPC)."""
    rid = producer.add_request(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while not producer._requests[rid].output_token_ids:
        producer.step()
    src = producer._requests[rid]
    res = consumer.reserve_import(f"imported-{rid}", len(prompt))
    for layer, kv in consumer.cache.kv.items():
        kv[res.page_ids] = producer.cache.kv[layer][src.page_ids[: len(res.page_ids)]]
    for name in ("recurrent", "conv"):
        for layer, t in getattr(consumer.cache, name).items():
            t[res.slot_ids[0]] = getattr(producer.cache, name)[layer][src.slot_ids[0]]
    consumer.insert_prefilled(res, prompt, params, src.output_token_ids[0], None)
    producer.abort_request(rid)
    return res.request_id


def test_pd_imports_join_overlapped_steps(model_dir):
    """Requests imported between steps (decode workers: every request arrives this way) join the next
    overlapped step with their host-side first token; nothing drains, and every token equals the
    sequential engine's under the same arrivals."""
    prompts = random_prompts(6, LENGTHS, seed=11)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    results = {}
    for overlap in (False, True):
        producer = make_engine(model_dir, max_num_seqs=8)
        eng = _engine(model_dir, overlap)
        ids = [_import(eng, producer, p, greedy) for p in prompts[:2]]
        done, steps = {}, 0
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.output_token_ids
            steps += 1
            if steps in (3, 7):  # two more imports, between overlapped steps
                ids += [_import(eng, producer, p, greedy) for p in prompts[2 + 2 * (steps == 7) :][:2]]
        results[overlap] = [done[i] for i in ids]
        if overlap:
            counts = eng.overlap.counts
            assert counts["joined"] == 4 and counts["drained"] <= 1, counts
            _assert_nothing_held(eng)
    assert results[True] == results[False]


def test_sampled_rows_run_in_sequence(model_dir):
    """Seeded sampling and logprobs take the host sampler: such steps are never overlapped, and the tokens
    equal the sequential engine's."""
    prompts = random_prompts(4, LENGTHS, seed=9)
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    ]
    ref, _ = _run(model_dir, prompts, params, overlap=False)
    got, eng = _run(model_dir, prompts, params, overlap=True)
    assert got == ref
    assert eng.overlap.counts["launched"] == 0
    _assert_nothing_held(eng)


def test_prefix_cache_rungs_with_overlap(tiny_models):
    """Rung checkpoints are due every 64 tokens: those steps drain and run in sequence; reuse is exact."""
    model_dir = tiny_models["kimi_linear"]
    kw = dict(enable_prefix_caching=True, kda_checkpoint_pages=4)
    prompts = random_prompts(2, [40, 70], seed=2)
    long = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    ref_eng = _engine(model_dir, False, **kw)
    eng = _engine(model_dir, True, **kw)
    first = [o.output_token_ids for o in eng.generate(prompts, long)]
    assert first == [o.output_token_ids for o in ref_eng.generate(prompts, long)]
    again = [p + o[:60] for p, o in zip(prompts, first, strict=True)]
    short = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert [o.output_token_ids for o in eng.generate(again, short)] == [
        o.output_token_ids for o in ref_eng.generate(again, short)
    ]
    assert eng.overlap.counts["continued"] > 20


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(async_scheduling=True), "needs cuda_graphs"),
        (
            dict(async_scheduling=True, cuda_graphs=True, speculative={"method": "ngram", "num_speculative_tokens": 2}),
            "speculative",
        ),
    ],
)
def test_config_refuses_unsupported(tiny_models, kw, match):
    from engine.config import EngineConfig, SpeculativeConfig

    if "speculative" in kw:
        kw["speculative"] = SpeculativeConfig(**kw["speculative"])
    with pytest.raises(ValueError, match=match):
        EngineConfig(model=str(tiny_models["qwen3"]), **kw)
