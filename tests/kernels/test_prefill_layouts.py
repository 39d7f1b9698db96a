"""KDA cores inside the prefill graphs for repeated layouts (engine/prefill_graph/layouts.py).

A layout's graph is captured once over fixed-address metadata; each later step with the layout writes its own
slots into those buffers (``GPUKDABackend.bind_static``) before the replay. Here: the buffers keep their
addresses, the layout key refuses what a graph would freeze wrongly, a core run on the capture batch after
binding a real step computes that step (its slots, not the capture's), on CUDA the same through a captured
graph replayed for two different steps, and whole engines (host: the inline cores run eagerly, as a replay
would; CUDA: replayed) give the reference tokens.
"""

from __future__ import annotations

import pytest
import torch

from engine.backends.gpu import GPUKDABackend
from engine.backends.torch_ref import TorchKDABackend
from engine.prefill_graph.layouts import LayoutBook, capture_batch
from engine.sampling_params import SamplingParams
from kernels.upload import StaticUploads
from tests.conftest import make_engine, random_prompts
from tests.kernels.helpers import DEVICE, ON_CUDA, assert_close, needs_cuda
from tests.kernels.test_gpu_backend import gpu_backends, make_batch, reference_chunk_fn

pytestmark = pytest.mark.usefixtures("fla_unblocked")

H, KD, W, SLOTS, PAD = 2, 16, 4, 24, 23


def test_static_uploads_refill_the_same_buffers():
    up = StaticUploads()
    a = up(torch.tensor([1, 2, 3], dtype=torch.int32), DEVICE)
    b = up(torch.tensor([7], dtype=torch.int64), DEVICE)
    up.rewind()
    a2 = up(torch.tensor([4, 5, 6], dtype=torch.int32), DEVICE)
    b2 = up(torch.tensor([8], dtype=torch.int64), DEVICE)
    assert (a2.data_ptr(), b2.data_ptr()) == (a.data_ptr(), b.data_ptr())
    assert a.tolist() == [4, 5, 6] and b.tolist() == [8]
    up.rewind()
    with pytest.raises(ValueError, match="static upload 0"):
        up(torch.tensor([1, 2], dtype=torch.int32), DEVICE)  # another layout's shapes


def test_layout_key_names_what_the_launches_follow():
    be = GPUKDABackend(chunk_fn=None if ON_CUDA else reference_chunk_fn)
    plain = make_batch([40, 300], [40, 340], 16, 64)
    assert be.layout_key(plain) == ((40, 300), (False, True))
    assert be.layout_key(make_batch([40, 1], [40, 9], 16, 64)) is None  # a decode row: its own kernel
    cks = make_batch([150], [150], 16, 64, checkpoints=[((64, 20),)])
    assert be.layout_key(cks) is None  # a rung copy at a host-chosen slot
    pad = make_batch([40], [40], 16, 64)
    pad.state_slots[0] = -1
    assert be.layout_key(pad) is None


def test_layout_book_gives_graphs_from_the_second_sighting():
    be = GPUKDABackend(chunk_fn=None if ON_CUDA else reference_chunk_fn)
    book = LayoutBook(max_layouts=1)
    made = []

    def make(key):
        made.append(key)
        return capture_batch(key, torch.zeros(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64), PAD)

    a, b = make_batch([40], [40], 16, 64), make_batch([50], [50], 16, 64)
    assert book.lookup(be, a, make) is None  # first sighting: the bucket's pieces
    assert book.lookup(be, b, make) is None  # over the bound: never gets graphs
    got = book.lookup(be, a, make)
    assert got is not None and got.key == ((40,), (False,)) and book.lookup(be, a, make) is got
    assert book.lookup(be, b, make) is None and made == [got.key]
    assert got.batch.state_slots == [PAD] and got.batch.num_tokens == 40


def _kda_case(batch, seed):
    gen = torch.Generator().manual_seed(seed)
    c = 3 * H * KD
    x = torch.randn(batch.num_tokens, c, generator=gen).to(DEVICE)
    g = -torch.rand(batch.num_tokens, H, KD, generator=gen).to(DEVICE)
    beta = torch.rand(batch.num_tokens, H, generator=gen).to(DEVICE)
    return x, g, beta


def _caches(seed):
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randn(SLOTS, 3 * H * KD, W - 1, generator=gen).to(DEVICE)
    rec = (torch.randn(SLOTS, H, KD, KD, generator=gen) * 0.1).to(DEVICE)
    weight = torch.randn(3 * H * KD, W, generator=gen).to(DEVICE)
    return conv, rec, weight


# 300 rows: fla's conv on CUDA (>= 256), the slot kernel on the host; a first chunk and a continued one
LENS, CTX = [40, 300], [40, 340]


def _steps():
    """Two steps of one layout on different slots (make_batch puts sequence i on slot 2i+1)."""
    one = make_batch(LENS, CTX, 16, 64)
    two = make_batch(LENS, CTX, 16, 64)
    two.state_slots = [6, 2]
    return one, two


def test_core_on_the_bound_capture_batch_computes_the_real_step():
    """conv_recurrence called with the layout's capture batch (every sequence on the scratch slot) after
    bind_static(real step): the real step's outputs, states written to its slots only."""
    chunk_fn = None if ON_CUDA else reference_chunk_fn
    be = GPUKDABackend(chunk_fn=chunk_fn)
    ids = torch.zeros(sum(LENS), dtype=torch.int64, device=DEVICE)
    cap = capture_batch(be.layout_key(_steps()[0]), ids, ids, PAD)
    up = StaticUploads()
    for seed, step in enumerate(_steps()):
        conv, rec, weight = _caches(seed)
        x, g, beta = _kda_case(step, seed)
        conv_ref, rec_ref = conv.clone(), rec.clone()
        want = TorchKDABackend().conv_recurrence(x, conv_ref, weight, g, beta, rec_ref, step)
        be.bind_static(step, cap, up)
        got = be.conv_recurrence(x, conv, weight, g, beta, rec, cap)
        tol = 5e-3 if ON_CUDA else 1e-5  # fla's chunk kernels use TF32 dots on the GPU
        assert_close(f"o, step {seed}", want, got.float(), tol)
        assert_close(f"recurrent state, step {seed}", rec_ref, rec, tol)
        assert_close(f"conv windows, step {seed}", conv_ref, conv, 1e-6)
    with pytest.raises(ValueError, match="one layout"):
        be.bind_static(make_batch([41, 300], [41, 340], 16, 64), cap, up)


@needs_cuda
def test_core_graph_replays_each_bound_step():
    """The core captured as a CUDA graph on the capture batch, then replayed after binding each real step:
    bit for bit what the core computes eagerly on that step (same kernels, same shapes)."""
    be = GPUKDABackend()
    one, two = _steps()
    ids = torch.zeros(sum(LENS), dtype=torch.int64, device=DEVICE)
    cap = capture_batch(be.layout_key(one), ids, ids, PAD)
    up = StaticUploads()
    conv, rec, weight = _caches(0)
    x, g, beta = (t.clone() for t in _kda_case(one, 0))
    be.bind_static(cap, cap, up)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        be.conv_recurrence(x, conv.clone(), weight, g, beta, rec.clone(), cap)  # warm-up (autotune) on copies
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = be.conv_recurrence(x, conv, weight, g, beta, rec, cap)
    for seed, step in enumerate((one, two)):
        c0, r0, _ = _caches(seed)
        x_s, g_s, b_s = _kda_case(step, seed)
        conv.copy_(c0), rec.copy_(r0), x.copy_(x_s), g.copy_(g_s), beta.copy_(b_s)
        conv_ref, rec_ref = c0.clone(), r0.clone()
        want = GPUKDABackend().conv_recurrence(x_s, conv_ref, weight, g_s, b_s, rec_ref, step)
        be.bind_static(step, cap, up)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"step {seed}: o differs"
        assert torch.equal(rec, rec_ref) and torch.equal(conv, conv_ref), f"step {seed}: states differ"


def test_engine_tokens_with_layout_graphs(tiny_models):
    """Prompts of one length, one after another: from the second, every chunk's layout has been seen, so its
    KDA cores run inline on the layout's capture batch (on CUDA: inside the replayed pieces), on a new slot
    each time. Greedy tokens == the reference backends'; the layout path ran."""
    prompts = random_prompts(3, [100, 100, 100], seed=8)  # chunks of 48, 48, 4 tokens with a 48-token budget
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ref = make_engine(tiny_models["kimi_linear"], max_num_batched_tokens=48)
    kw = dict(device="cuda", dtype="float32") if ON_CUDA else {}
    eng = make_engine(tiny_models["kimi_linear"], max_num_batched_tokens=48, cuda_graphs=True, **kw)
    eng.model.backends = gpu_backends()
    slots = []
    for p in prompts:
        expected = ref.generate([p], params)[0].output_token_ids
        slots.append(eng.slots.allocate(1)[0])  # held: the next request takes another slot
        assert eng.generate([p], params)[0].output_token_ids == expected
    stats = eng.runner.prefill_graphs.stats()
    assert stats["layout_steps"] >= 6, stats  # prompts 2 and 3: their 48-token chunks
    assert stats["layouts_enabled"], stats
    if ON_CUDA:
        assert stats["layout_captures"] >= 2, stats


def test_pinned_staging_uploads_arrays_in_one_copy():
    """The model runner's step arrays (kernels/upload.PinnedStaging): values and order kept, buffers used in
    turn and grown past their capacity; on the host the arrays come back as they are."""
    import numpy as np

    from kernels.upload import PinnedStaging

    staging = PinnedStaging(DEVICE, capacity=8)
    for step in range(4):  # both buffers twice, the third step grows them
        arrays = [np.arange(step, step + 5, dtype=np.int64), np.zeros(0, np.int64), np.full(step * 3, -1, np.int64)]
        got = staging.upload(arrays)
        assert [t.device.type for t in got] == [DEVICE.type] * 3
        assert [t.cpu().tolist() for t in got] == [a.tolist() for a in arrays]


@pytest.mark.skipif(ON_CUDA, reason="captures stood in for by the eager padded forward: the host's check")
def test_capture_graphs_takes_the_full_chunk_layouts_up_front(tiny_models, monkeypatch):
    """A worker's startup capture (``LLMEngine.capture_graphs``) with KDA layers: every bucket, then a long
    prompt's two full-chunk layouts (first chunk, later chunks from a state). A long prompt then runs its full
    chunks through those layouts with no capture of its own; greedy tokens == the reference's."""
    from engine.prefill_graph.pieces import EagerRun

    budget = 64
    eng = make_engine(tiny_models["kimi_linear"], max_num_batched_tokens=budget, cuda_graphs=True)
    eng.model.backends = gpu_backends()
    pg = eng.runner.prefill_graphs
    captured = []

    class EagerPieces:  # replays the padded forward eagerly, the layout's KDA cores inline
        graphs: tuple = ()

        def __init__(self, bucket, layout):
            self.bucket, self.layout = bucket, layout

        def replay(self, batch, n):
            return pg._forward(self.bucket, EagerRun(batch, n, self.bucket), self.layout)

    def capture(bucket, layout=None):
        captured.append((bucket, None if layout is None else layout.key))
        pieces = pg._pieces[bucket if layout is None else (bucket, layout.key)] = EagerPieces(bucket, layout)
        return pieces

    monkeypatch.setattr(pg, "_capture", capture)
    pg.capture = True
    assert eng.capture_graphs() == len(pg.buckets)
    full = [(budget, ((budget,), (False,))), (budget, ((budget,), (True,)))]
    assert captured == [(b, None) for b in reversed(pg.buckets)] + full
    prompt = random_prompts(1, [3 * budget + 10], seed=12)[0]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    want = make_engine(tiny_models["kimi_linear"], max_num_batched_tokens=budget).generate([prompt], params)
    assert eng.generate([prompt], params)[0].output_token_ids == want[0].output_token_ids
    assert len(captured) == len(pg.buckets) + 2  # nothing captured while serving
    assert pg.stats()["layout_steps"] == 3  # the three full chunks; the 10-token tail takes its bucket's pieces


@needs_cuda
def test_startup_capture_serves_a_long_prompt_through_the_full_chunk_layouts(tiny_models):
    """On the GPU: capture_graphs() captures every bucket and both full-chunk layouts; a long prompt's full
    chunks then replay them (no capture while serving), tokens == the reference engine's (fp32)."""
    budget = 64
    eng = make_engine(
        tiny_models["kimi_linear"], max_num_batched_tokens=budget, cuda_graphs=True, device="cuda", dtype="float32"
    )
    pg = eng.runner.prefill_graphs
    assert eng.capture_graphs() == len(pg.buckets)
    stats = pg.stats()
    assert stats["layout_captures"] == 2 and stats["captures"] == len(pg.buckets), stats
    prompt = random_prompts(1, [3 * budget + 10], seed=12)[0]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    want = make_engine(tiny_models["kimi_linear"], max_num_batched_tokens=budget).generate([prompt], params)
    assert eng.generate([prompt], params)[0].output_token_ids == want[0].output_token_ids
    stats = pg.stats()
    assert stats["layout_steps"] == 3 and stats["layout_captures"] == 2, stats
    assert stats["captures"] == len(pg.buckets), stats


@pytest.mark.skipif(ON_CUDA, reason="host check of the inline cores; the GPU runs the replayed pieces above")
def test_hooks_see_the_real_steps_state_with_layouts(tiny_models):
    """The P/D producer reads a layer's pages and KDA state from its hook, between pieces: with the KDA cores
    inline on the layout's capture batch, the state must already sit in the real step's slots when the hook
    runs. Same hook calls, same KDA states seen, as an engine without the graphs."""
    budget = 48
    prompts = random_prompts(3, [100, 100, 100], seed=13)  # chunks 48, 48, 4: layouts repeat from prompt 2
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def recorded(eng) -> list[tuple]:
        calls: list[tuple] = []

        def hook(layer, b):
            if layer not in eng.cache.recurrent or b.num_seqs != 1 or b.q_len(0) == 1:
                return
            slot = b.state_slots[0]
            state, window = eng.cache.recurrent[layer][slot].double(), eng.cache.conv[layer][slot].double()
            sums = (state.sum().item(), window.sum().item())
            scales = (state.abs().sum().item(), window.abs().sum().item())
            calls.append((layer, b.num_tokens, tuple(b.request_ids), sums, scales))

        eng.model.layer_hooks.append(hook)
        for p in prompts:
            eng.generate([p], params)
        return calls

    plain = make_engine(tiny_models["kimi_linear"], max_num_batched_tokens=budget)
    plain.model.backends = gpu_backends()
    eng = make_engine(tiny_models["kimi_linear"], max_num_batched_tokens=budget, cuda_graphs=True)
    eng.model.backends = gpu_backends()
    want, have = recorded(plain), recorded(eng)
    assert [c[:3] for c in have] == [c[:3] for c in want] and len(want) >= 9
    # padded rows change the GEMMs' rounding (ULPs of each element: bounded by the sum of magnitudes, not by the
    # signed sum, which can cancel to ~0); a wrong slot or a stale state is off by whole units
    for h, w in zip(have, want, strict=True):
        for got, exp, scale in zip(h[3], w[3], w[4], strict=True):
            assert abs(got - exp) <= 1e-5 * scale, (h, w)
    assert eng.runner.prefill_graphs.stats()["layout_steps"] >= 4
