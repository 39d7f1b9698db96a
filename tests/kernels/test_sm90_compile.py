"""Every Triton kernel a decode step launches, compiled for the H200 on the host (tests/kernels/sm90_compile.py):
the launches are recorded from the engine's decode through the GPU backends under the interpreter, in fp32 and
bf16, one row (the skinny GEMMs, the norms inside them, the MoE pair rows) and batched (the sorted MoE layout,
the split attention), then each is compiled for sm_90 as it is and with PDL on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.sampling_params import SamplingParams
from tests.conftest import make_engine, random_prompts
from tests.kernels.helpers import ON_CUDA
from tests.kernels.sm90_compile import Launch, compile_errors, launch_of, record_launches
from tests.kernels.test_gpu_backend import gpu_backends

pytestmark = [
    pytest.mark.usefixtures("fla_unblocked"),
    pytest.mark.skipif(ON_CUDA, reason="records interpreted launches; on a GPU the kernel tests compile them anyway"),
]


def _ours(launches: set[Launch]) -> set[Launch]:
    return {x for x in launches if x.module.startswith("kernels.")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["kimi_linear", "qwen3"])
def test_decode_kernels_compile_for_the_h200(tiny_models, arch, dtype):
    from engine.backends.dense import TritonDense

    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    eng = make_engine(tiny_models[arch], max_num_batched_tokens=512, cuda_graphs=True, dtype=dtype)
    eng.model.backends = dataclasses.replace(gpu_backends(), dense=TritonDense())
    eng.model.pack_weights()  # as the engine does on CUDA
    with record_launches() as seen:
        eng.generate(random_prompts(1, [20], seed=1), params)  # one row: every one-row kernel
        eng.generate(random_prompts(3, [30, 9, 17], seed=2), params)  # batched: the sorted layouts, the splits
    launches = _ours(seen)
    kernels = {x.kernel for x in launches}
    want = {"_gemv_kernel", "_paged_attn_fwd_kernel"} | (
        {"_add_norm_gemv_kernel", "_gated_norm_gemv_kernel", "_gate_up_kernel", "_down_kernel", "_moe_combine_kernel"}
        if arch == "kimi_linear"
        else set()
    )
    assert want <= kernels, sorted(want - kernels)  # the recording saw the decode path
    if arch == "kimi_linear":
        pair_rows = {x for x in launches if x.kernel == "_gate_up_kernel" and ("PAIR_ROWS", True) in x.constexprs}
        assert pair_rows and len(launches) > len(pair_rows)
    print(f"{len(launches)} launches of {len(kernels)} kernels: {sorted(kernels)}")
    assert compile_errors(launches) == []


def test_a_kernel_that_does_not_compile_is_reported():
    """The check fails where the GPU would: the twenty-sixth session's pair-row helper, whose constexpr branch
    returned int32 rows before the int64 loads below it, passed the interpreter and failed to compile on the H200."""
    from kernels.moe.decode import _gate_up_kernel

    x = torch.zeros(1, 64)
    ids = torch.zeros(4, dtype=torch.int64)
    args = (x, ids, ids, ids, ids, torch.zeros(8, 128, 64), torch.zeros(4, 64), 64, 64, 4096, 64, 8192, 64, 64)
    blocks = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, DOT_F32=True, PREC="ieee", COMPACT=False, USE_PDL=False)
    good = launch_of(_gate_up_kernel, args, {**blocks, "PAIR_ROWS": True, "num_warps": 4})
    assert good is not None and ("ENDS", "*i64") in good.signature
    bad = dataclasses.replace(good, module="tests.kernels.sm90_bad_kernel", kernel="returns_two_types")
    errors = compile_errors([good, bad])
    assert len(errors) == 2, errors  # the bad kernel as recorded and with PDL on; the good one compiles
    assert all("returns_two_types" in e and "return type" in e.lower() for e in errors), errors
