"""kernels/prefetch: the pieces cover each range exactly once (under the interpreter, RECORD mode), the argument
errors, the prefetch form compiled for sm_90 with its instruction still in the PTX, and on a GPU: outputs unchanged,
and a GEMV after the prefetch reads the same bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.kernels.helpers import ON_CUDA

pytestmark = pytest.mark.usefixtures("fla_unblocked")


def _pieces(rec: torch.Tensor) -> dict[int, list[tuple[int, int]]]:
    rec = rec.cpu()
    assert not (rec == -2).any(), "a lane wrote nothing"
    out: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    for off, size in rec.tolist():
        if off < 0:
            assert size == 0
            continue
        out[off >> 40].append((off & ((1 << 40) - 1), size))
    return out


def _assert_covers(pieces: list[tuple[int, int]], nbytes: int) -> None:
    from kernels.prefetch.triton import CHUNK_BYTES

    pieces = sorted(pieces)
    at = 0
    for off, size in pieces:
        assert off == at and 0 < size <= CHUNK_BYTES and off % 16 == 0 and size % 16 == 0, (off, size, at)
        at += size
    assert at == nbytes // 16 * 16


@pytest.mark.parametrize(
    "shapes",
    [[(2304, 4096)], [(7,)], [(4096 * 32,)], [(2304, 4096), (999_990,)], [(2048, 2304), (2304, 1024)]],
)
def test_pieces_cover_each_range_once(shapes):
    from kernels.prefetch.triton import l2_prefetch

    dev = "cuda" if ON_CUDA else "cpu"
    tensors = [torch.zeros(s, dtype=torch.bfloat16 if len(s) == 2 else torch.uint8, device=dev) for s in shapes]
    if ON_CUDA or os.environ.get("TRITON_INTERPRET") == "1":
        pieces = _pieces(l2_prefetch(*tensors, record=True))
        for i, t in enumerate(tensors):
            _assert_covers(pieces[i], t.numel() * t.element_size())
        if len(tensors) == 1:
            assert pieces[1] == []


def test_argument_errors():
    from kernels.prefetch.triton import l2_prefetch

    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"1\.\.2 tensors"):
        l2_prefetch(w, w, w, record=True)
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(w.t(), record=True)
    with pytest.raises(ValueError, match="16-byte aligned"):
        l2_prefetch(w.view(-1)[1:], record=True)
    if not ON_CUDA:
        with pytest.raises(ValueError, match="needs a CUDA device"):
            l2_prefetch(w)


_COMPILE = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.prefetch.triton import _l2_prefetch_kernel, CHUNK_BYTES, LANES
sig = {"BASE_A": "*u8", "NBYTES_A": "i64", "PROGS_A": "i32", "BASE_B": "*u8", "NBYTES_B": "i64", "RECORD": "*u8",
       "CHUNK": "constexpr", "LANES": "constexpr", "RECORD_PIECES": "constexpr"}
src = ASTSource(_l2_prefetch_kernel, sig, {(6,): CHUNK_BYTES, (7,): LANES, (8,): False})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
ptx = k.asm["ptx"]
print(json.dumps({"prefetches": ptx.count("cp.async.bulk.prefetch.L2.global"), "cubin": len(k.asm["cubin"])}))
"""


@pytest.mark.skipif(ON_CUDA, reason="compiles for sm_90 on a host without a GPU; on a GPU the tests below launch it")
def test_prefetch_compiles_for_the_h200_with_its_instruction():
    """The asm has no result anyone reads: it must survive as a side effect (is_pure=False), not be removed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["prefetches"] >= 1 and got["cubin"] > 0, got


@pytest.mark.skipif(not ON_CUDA, reason="the prefetch instruction runs on a CUDA GPU only")
def test_prefetch_leaves_every_output_unchanged():
    from kernels.gemv.triton import gemv
    from kernels.prefetch.triton import l2_prefetch

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(2304, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w2 = torch.randn(2048, 2304, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    before, wc, w2c = gemv(x, w), w.clone(), w2.clone()
    for _ in range(3):
        l2_prefetch(w, w2)
        assert torch.equal(gemv(x, w), before)
    torch.cuda.synchronize()
    assert torch.equal(w, wc) and torch.equal(w2, w2c)
    graph = torch.cuda.CUDAGraph()  # captured too, as in the decode step's graph
    with torch.cuda.graph(graph):
        l2_prefetch(w)
        y = gemv(x, w)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, before)


@pytest.mark.skipif(not ON_CUDA, reason="the prefetch instruction runs on a CUDA GPU only")
def test_forked_prefetch_joins_eagerly_and_in_a_graph():
    """The engine's form: the prefetch on a side stream, the reader after ``join``; captured, the fork and the join
    are edges of the graph (capture fails on a fork left open)."""
    from engine.backends.prefetch import L2Prefetch
    from kernels.gemv.triton import gemv

    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(2304, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    want = gemv(x, w)
    be = L2Prefetch(max_rows=1)
    be.weights(1, w)
    assert be._pending is not None
    be.join()
    assert be._pending is None and torch.equal(gemv(x, w), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        be.weights(1, w)
        torch.cuda._sleep(10_000)
        be.join()
        y = gemv(x, w)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, want)


# ---- the backend and the engine ----------------------------------------------------------------------------------


def test_backend_asks_at_few_rows_on_cuda_only(monkeypatch):
    from engine.backends.prefetch import L2Prefetch, NoPrefetch, gpu_prefetch_backend

    asked = []
    be = L2Prefetch(max_rows=2)
    be._prefetch = lambda *ts: asked.append(ts)
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    be.weights(1, w)
    assert asked == []  # a CPU tensor: nothing to prefetch
    if ON_CUDA:
        wc, wc2 = w.cuda(), torch.zeros(40, 8, device="cuda")
        be.weights(1, wc, wc2.t())  # the strided view is left out, the rest asked
        be.weights(2, wc)
        be.weights(3, wc)  # more rows than max_rows: nothing
        assert [len(ts) for ts in asked] == [1, 1]
    monkeypatch.setenv("TANDEM_L2_PREFETCH_ROWS", "0")
    assert type(gpu_prefetch_backend()) is NoPrefetch
    monkeypatch.setenv("TANDEM_L2_PREFETCH_ROWS", "4")
    assert gpu_prefetch_backend().max_rows == 4
    for bad in ("-1", "x"):
        monkeypatch.setenv("TANDEM_L2_PREFETCH_ROWS", bad)
        with pytest.raises(ValueError, match="TANDEM_L2_PREFETCH_ROWS"):
            gpu_prefetch_backend()
    with pytest.raises(ValueError, match="max_rows"):
        L2Prefetch(0)


class _Recorder:
    """Records the model's asks (rows, data pointers) and its joins (``"join"``) in order."""

    max_rows = 1

    def __init__(self) -> None:
        self.log: list[tuple[int, tuple[int, ...]] | str] = []

    @property
    def calls(self) -> list[tuple[int, tuple[int, ...]]]:
        return [x for x in self.log if x != "join"]

    def weights(self, rows: int, *tensors: torch.Tensor) -> None:
        self.log.append((rows, tuple(t.data_ptr() for t in tensors)))

    def join(self) -> None:
        self.log.append("join")

    def assert_each_ask_joined(self) -> None:
        """Every ask is followed by a join before the next ask (the reader waits for its own prefetch)."""
        open_ask = None
        for x in self.log:
            if x == "join":
                open_ask = None
            else:
                assert open_ask is None, f"{open_ask} asked and never joined before {x}"
                open_ask = x
        assert open_ask is None


@pytest.mark.skipif(ON_CUDA, reason="CPU engine with interpreted kernels; the GPU test below runs the real prefetch")
def test_one_row_steps_ask_for_the_weights_after_each_window(tiny_models, monkeypatch):
    """Every decode step (one row) of the tiny Kimi model asks, per layer, for its attention's o_proj (KDA and MLA)
    and, per MoE layer, for the folded shared expert's gate | up and down; the tokens are the reference's."""
    import dataclasses

    from engine.sampling_params import SamplingParams
    from tests.conftest import make_engine, random_prompts
    from tests.kernels.test_gpu_backend import gpu_backends

    monkeypatch.setenv("TANDEM_PACK_WEIGHTS", "1")
    prompt = random_prompts(1, [23], seed=8)[0]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    want = make_engine(tiny_models["kimi_linear"]).generate([prompt], params)[0].output_token_ids
    eng = make_engine(tiny_models["kimi_linear"])
    rec = _Recorder()
    eng.model.backends = dataclasses.replace(gpu_backends(), l2=rec)
    assert eng.generate([prompt], params)[0].output_token_ids == want
    layers = eng.model.layers
    per_step = [(layer.self_attn.o_proj.weight.data_ptr(),) for layer in layers]
    per_step += [
        tuple(t.data_ptr() for t in layer.block_sparse_moe._shared_streams) for layer in layers if layer.is_moe
    ]
    one_row = [ptrs for rows, ptrs in rec.calls if rows == 1]
    assert sorted(one_row) == sorted(per_step * (params.max_tokens - 1))
    rec.assert_each_ask_joined()
    assert {rows for rows, _ in rec.calls} == {1, 23}  # the prefill asks too; the backend drops long steps
    moe = next(layer.block_sparse_moe for layer in layers if layer.is_moe)
    gate_up, down = moe._shared_streams
    assert gate_up.is_contiguous() and down.is_contiguous()
    assert torch.equal(gate_up, moe.shared_experts.gate_up.weight) and torch.equal(
        down, moe.shared_experts.down_proj.weight
    )


@pytest.mark.skipif(ON_CUDA, reason="CPU engine with interpreted kernels; the GPU test below runs the real prefetch")
def test_qwen3_steps_ask_for_o_proj(tiny_models):
    import dataclasses

    from engine.sampling_params import SamplingParams
    from tests.conftest import make_engine, random_prompts
    from tests.kernels.test_gpu_backend import gpu_backends

    eng = make_engine(tiny_models["qwen3"])
    rec = _Recorder()
    eng.model.backends = dataclasses.replace(gpu_backends(), l2=rec)
    eng.generate(random_prompts(1, [11], seed=3), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    want = [(layer.self_attn.o_proj.weight.data_ptr(),) for layer in eng.model.layers]
    assert sorted(p for rows, p in rec.calls if rows == 1) == sorted(want * 2)
    rec.assert_each_ask_joined()


@pytest.mark.skipif(not ON_CUDA, reason="the prefetch instruction runs on a CUDA GPU only")
def test_engine_tokens_unchanged_by_the_prefetch(tiny_models, monkeypatch):
    from engine.backends import select_backends
    from engine.sampling_params import SamplingParams
    from tests.conftest import make_engine, random_prompts

    prompts = random_prompts(3, [23, 40, 9], seed=8)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = {}
    for rows in ("0", "1"):
        monkeypatch.setenv("TANDEM_L2_PREFETCH_ROWS", rows)
        eng = make_engine(tiny_models["kimi_linear"], device="cuda", dtype="bfloat16", cuda_graphs=True)
        assert type(eng.model.backends.l2) is type(select_backends(torch.device("cuda")).l2)
        outs[rows] = [eng.generate([p], params)[0].output_token_ids for p in prompts]
    assert outs["1"] == outs["0"]
