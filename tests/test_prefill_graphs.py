"""Piecewise prefill steps (engine/prefill_graph) on the host: the padded forward with the cores cut out runs
eagerly here (``EagerRun``), so these compare the padding, the row slicing at the cores and the hooks between
pieces with the normal path, token for token and logit for logit in fp32. The captured graphs and their replay
are compared on the GPU (tests/kernels/test_prefill_graphs_gpu.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.prefill_graph import default_token_buckets
from engine.prefill_graph.pieces import CoreStep, EagerRun
from engine.sampling_params import SamplingParams
from tests.conftest import make_engine, random_prompts


def _sampled_logits(eng) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    sample = eng.sampler.sample

    def recording(logits, requests):
        seen.append(logits.detach().clone())
        return sample(logits, requests)

    eng.sampler.sample = recording
    return seen


def test_token_buckets() -> None:
    assert default_token_buckets(8192) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048,
                                           3072, 4096, 5120, 6144, 7168, 8192]  # fmt: skip
    assert default_token_buckets(1000) == [16, 32, 64, 128, 256, 512, 768, 1000]
    assert default_token_buckets(16) == [16]


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["plain", "prefix_cache"])
def test_padded_steps_match_the_eager_path(model_dir, prefix_caching) -> None:
    """Chunked prefill (700 > 512 tokens), prefill chunks mixed with decode rows, a shared prefix (prefix hit,
    KDA rung checkpoints); the steps the decode graphs do not take run padded to a bucket."""
    shared = random_prompts(1, [200], seed=11)[0]
    prompts = [*random_prompts(3, [70, 700, 9], seed=4), shared + [5, 6, 7], shared + [8, 9]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    kw = dict(max_num_batched_tokens=512, enable_prefix_caching=prefix_caching, kda_checkpoint_pages=4)
    ref = make_engine(model_dir, **kw)
    eng = make_engine(model_dir, cuda_graphs=True, **kw)
    ref_logits, got_logits = _sampled_logits(ref), _sampled_logits(eng)
    expected = [o.output_token_ids for o in ref.generate(prompts, params)]
    got = [o.output_token_ids for o in eng.generate(prompts, params)]
    stats = eng.runner.prefill_graphs.stats()
    assert stats["eager_padded_steps"] >= 2 and stats["padded_rows"] > 0, stats
    assert eng.runner.decode_graphs.stats()["eager_static_steps"] >= 1
    assert got == expected
    assert len(got_logits) == len(ref_logits)
    for have, want in zip(got_logits, ref_logits, strict=True):
        torch.testing.assert_close(have, want, atol=1e-4, rtol=0)  # GEMMs at the bucket's rows: ULPs
    if not prefix_caching:  # nothing held after the requests finish but the padding rows' scratch page
        assert (ref.pages.num_used, eng.pages.num_used, eng.pages_in_use) == (0, 1, 0)


def test_hooks_run_between_pieces_with_the_real_batch(model_dir) -> None:
    """A layer hook (the P/D producer's way in) sees the step's own batch, layer by layer, as on the eager path."""
    prompts = random_prompts(2, [40, 130], seed=9)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    def recorded(eng) -> list[tuple]:
        calls: list[tuple] = []
        eng.model.layer_hooks.append(
            lambda layer, b: calls.append((layer, b.num_tokens, tuple(b.context_lens), tuple(b.request_ids)))
        )
        eng.generate(prompts, params)
        return calls

    ref = make_engine(model_dir, max_num_batched_tokens=512)
    eng = make_engine(model_dir, max_num_batched_tokens=512, cuda_graphs=True)
    want, have = recorded(ref), recorded(eng)
    assert have == want and len(want) >= 3 * eng.model_config.num_hidden_layers
    stats = eng.runner.prefill_graphs.stats()
    assert stats["eager_padded_steps"] >= 3, stats  # decode graphs refuse hooked steps: the decode steps too


def test_prefill_graphs_off_and_drafter_taps(model_dir) -> None:
    eng = make_engine(model_dir, cuda_graphs=True, prefill_graph_max_tokens=0)
    assert eng.runner.prefill_graphs is None
    with pytest.raises(ValueError, match="prefill_graph_max_tokens"):
        make_engine(model_dir, prefill_graph_max_tokens=-1)
    eng = make_engine(model_dir, cuda_graphs=True, max_num_batched_tokens=256)
    assert eng.runner.prefill_graphs.buckets[-1] == 256  # capped by the step's token budget
    eng.model.aux_layer_ids = (0,)
    req = random_prompts(1, [20])[0]
    eng.add_request(req, SamplingParams(max_tokens=1))
    chunks = eng.scheduler.schedule().chunks
    assert not eng.runner.prefill_graphs.accepts(chunks)  # drafter taps read the whole forward's rows


def test_eager_run_pads_core_outputs_with_zero_rows() -> None:
    x = torch.arange(12.0).reshape(6, 2)
    run = EagerRun(batch="real", n=4, rows=6)  # type: ignore[arg-type]
    seen = []

    def core(batch, rows):
        seen.append((batch, rows.shape[0]))
        return rows + 1, rows * 2

    a, b = run.core(core, (x,))
    assert seen == [("real", 4)]
    assert torch.equal(a[:4], x[:4] + 1) and torch.equal(b[:4], x[:4] * 2)
    assert not a[4:].any() and not b[4:].any()
    assert run.core(lambda batch, rows: None, (x,)) is None
    seen.clear()
    run.boundary(lambda batch: seen.append(batch))
    EagerRun(batch="capture", n=6, rows=6, hooks=False).boundary(lambda batch: seen.append(batch))  # type: ignore[arg-type]
    assert seen == ["real"]  # a warm-up on the capture batch calls no hook


def test_core_step_copies_the_real_rows_and_zeroes_padding() -> None:
    static_in = torch.arange(10.0).reshape(5, 2)
    static_out = torch.full((5, 2), float("nan"))
    step = CoreStep(lambda batch, rows: rows * 10, (static_in,), (static_out,))
    step.run("real", 3)  # type: ignore[arg-type]
    assert torch.equal(static_out[:3], static_in[:3] * 10)
    assert not static_out[3:].any()  # the pool's old contents (here NaN) never reach the padding rows


def _fake_captures(eng, monkeypatch) -> list[tuple[int, tuple]]:
    """Captures stood in for by the eager padded forward (no CUDA here): what is checked is when the engine
    captures, with which hooks. Returns the (bucket, hooks) of every capture, in order."""
    pg = eng.runner.prefill_graphs
    captured: list[tuple[int, tuple]] = []

    class EagerPieces:
        graphs: tuple = ()

        def __init__(self, bucket: int) -> None:
            self.bucket = bucket

        def replay(self, batch, n):
            return pg._forward(self.bucket, EagerRun(batch, n, self.bucket))

    def capture(bucket: int):
        captured.append((bucket, tuple(eng.model.layer_hooks)))
        pg._pieces[bucket] = EagerPieces(bucket)
        return pg._pieces[bucket]

    monkeypatch.setattr(pg, "_capture", capture)
    pg.capture = True
    return captured


def test_pieces_are_captured_again_when_the_layer_hooks_change(model_dir, monkeypatch) -> None:
    """Pieces hold the hooks they were captured with (a boundary per layer, the hook list of that moment): the
    P/D producer attaches its hook after the engine is built, so a bucket captured before (a warm-up step) must
    be captured again, or its replays would never call the producer. The same for other backends."""
    eng = make_engine(model_dir, cuda_graphs=True)
    captured = _fake_captures(eng, monkeypatch)
    prompt = random_prompts(1, [40], seed=8)[0]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    want = eng.generate([prompt], params)[0].output_token_ids
    assert eng.generate([prompt], params)[0].output_token_ids == want
    assert captured == [(64, ())]  # one capture of the 64-token bucket, reused
    seen: list[int] = []

    def hook(layer, batch):
        seen.append(layer)

    eng.model.layer_hooks.append(hook)
    assert eng.generate([prompt], params)[0].output_token_ids == want
    assert captured[1:] == [(64, (hook,))] and seen == list(range(eng.model_config.num_hidden_layers))
    eng.model.layer_hooks.remove(hook)
    eng.generate([prompt], params)
    assert captured[2:] == [(64, ())]
    eng.model.backends = dataclasses.replace(eng.model.backends)  # other backends: their kernels, captured again
    assert eng.generate([prompt], params)[0].output_token_ids == want
    assert captured[3:] == [(64, ())]
    assert eng.runner.prefill_graphs.stats()["graph_steps"] == 5


def test_capture_graphs_takes_every_bucket_up_front(model_dir, monkeypatch) -> None:
    """What a worker does before it reports ready: every bucket, largest first, with the hooks present then;
    steps after it capture nothing. On the host (no CUDA) there is nothing to capture."""
    eng = make_engine(model_dir, cuda_graphs=True, max_num_batched_tokens=256)
    assert eng.capture_graphs() == 0  # the host: the padded steps run eagerly, no graphs
    assert make_engine(model_dir).capture_graphs() == 0  # no cuda_graphs: nothing to capture either
    captured = _fake_captures(eng, monkeypatch)
    hook = lambda layer, batch: None
    eng.model.layer_hooks.append(hook)
    assert eng.capture_graphs() == 5
    assert captured == [(b, (hook,)) for b in (256, 128, 64, 32, 16)]
    assert eng.capture_graphs() == 0  # all there already
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    ref = make_engine(model_dir, max_num_batched_tokens=256)
    prompts = random_prompts(2, [40, 200], seed=9)
    want = [o.output_token_ids for o in ref.generate(prompts, params)]
    assert [o.output_token_ids for o in eng.generate(prompts, params)] == want
    assert len(captured) == 5 and eng.runner.prefill_graphs.stats()["graph_steps"] >= 1


def test_workers_capture_at_start_unless_lazy() -> None:
    from tandem.cli import build_parser, engine_config_from_args

    for role in ("prefill", "decode"):
        assert engine_config_from_args(build_parser().parse_args([role, "--cuda-graphs"])).capture_graphs_at_start
        lazy = build_parser().parse_args([role, "--cuda-graphs", "--lazy-graphs"])
        assert not engine_config_from_args(lazy).capture_graphs_at_start
