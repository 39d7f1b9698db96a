"""Every Triton kernel a decode step launches, compiled for the H200 on the host (tests/kernels/sm90_compile.py):
the launches are recorded from the engine's decode through the GPU backends under the interpreter, in fp32 and
bf16, one row (the skinny GEMMs, the norms inside them, the MoE pair rows) and batched (the sorted MoE layout,
the split attention), then each is compiled for sm_90 as it is and with PDL on; and the kernels the host engine does
not launch (device argmax, FlashMLA's plan, the prefill GEMMs, the handoff copies) through their own calls."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from engine.sampling_params import SamplingParams
from tests.conftest import make_engine, random_prompts
from tests.kernels.helpers import ON_CUDA
from tests.kernels.sm90_compile import Launch, as_on_the_gpu, compile_errors, launch_of, ptx_of, record_launches
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
    from engine.backends.norm import FlaNormBackend

    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    eng = make_engine(tiny_models[arch], max_num_batched_tokens=512, cuda_graphs=True, dtype=dtype)
    backends = dataclasses.replace(gpu_backends(), dense=TritonDense(add_norm=True), norm=FlaNormBackend())
    eng.model.backends = backends
    if arch == "kimi_linear":
        backends.moe.route_gate_up = True  # the default (engine/backends/gpu_moe.py), set here all the same
    eng.model.pack_weights()  # as the engine does on CUDA
    with record_launches() as seen:
        eng.generate(random_prompts(1, [20], seed=1), params)  # one row: every one-row kernel
        eng.generate(random_prompts(3, [30, 9, 17], seed=2), params)  # batched: the sorted layouts, the splits
        # the first input norm on its own again: the add-norm GEMV (off by default) takes it at one row; the MoE's
        # combine + next norm in a launch of its own (TANDEM_MOE_DOWN_NORM=0)
        eng.model.backends = dataclasses.replace(backends, norm=FlaNormBackend(embed_norm=False))
        if arch == "kimi_linear":
            backends.moe.down_norm = backends.moe.route_gate_up = False
        eng.generate(random_prompts(1, [20], seed=1), params)
    launches = _ours(seen)
    kernels = {x.kernel for x in launches}
    want = {"_gemv_kernel", "_paged_attn_fwd_kernel", "_embed_rms_norm_kernel"}
    want |= {"_qk_norm_rope_write_kernel"} if arch == "qwen3" else set()  # the q / k norms, RoPE and the K | V write
    want |= (
        {"_add_norm_gemv_kernel", "_gated_norm_gemv_kernel", "_gate_up_kernel", "_down_kernel", "_moe_combine_kernel"}
        | {"_router_route_kernel", "_sigmoid_topk_kernel"}  # one-row steps route in one launch, batched in two
        | {"_route_gate_up_kernel"}  # one-row steps: the routing inside the gate-up launch
        | {"_down_combine_norm_kernel"}  # one-row steps: the combine and the next norm in the down launch
        | {"_moe_combine_add_norm_kernel"}  # the same in a launch of its own
        | {"_head_gemv_kernel"}  # one query: MLA's W_UK and W_UV^T
        if arch == "kimi_linear"
        else set()
    )
    assert want <= kernels, sorted(want - kernels)  # the recording saw the decode path
    if arch == "kimi_linear":
        pair_rows = {x for x in launches if x.kernel == "_gate_up_kernel" and ("PAIR_ROWS", True) in x.constexprs}
        assert pair_rows and len(launches) > len(pair_rows)
    # one-row steps: the post-attention norm in the output projection's last program (kernels/gemv/norm_after.py)
    o_proj = {"_gemv_kernel"} | ({"_gated_norm_gemv_kernel"} if arch == "kimi_linear" else set())
    norm_after = {x.kernel for x in launches if ("NORM_AFTER", True) in x.constexprs}
    assert o_proj <= norm_after, sorted(norm_after)
    if arch == "kimi_linear":  # decode steps: KDA's up-projections in the short conv's launch
        assert any(x.kernel == "_short_conv_kernel" and ("LOW_RANK", True) in x.constexprs for x in launches)
    print(f"{len(launches)} launches of {len(kernels)} kernels: {sorted(kernels)}")
    assert compile_errors(launches) == []


def test_gpu_only_decode_kernels_compile_for_the_h200():
    """The decode kernels the host engine does not launch (greedy argmax on the device, FlashMLA's split plan, the
    router GEMV, the split-key merge, the block align of long steps), called directly in bf16 and fp32."""
    from kernels.flashmla.combine import split_combine
    from kernels.flashmla.plan import even_blocks_plan
    from kernels.moe.align import moe_align_blocks
    from kernels.moe.router import router_partials
    from kernels.paged_attention.triton import paged_gqa_attention_triton
    from kernels.sampling.triton import argmax_rows

    g = torch.Generator().manual_seed(0)
    with record_launches() as seen:
        for dtype in (torch.float32, torch.bfloat16):
            argmax_rows(torch.randn(3, 1000, generator=g).to(dtype))
            argmax_rows(torch.randn(3, 5000, generator=g).to(dtype), ticket=torch.zeros(1, dtype=torch.int32))
            router_partials(torch.randn(1, 256, generator=g).to(dtype), torch.randn(64, 256, generator=g).to(dtype))
        even_blocks_plan(torch.tensor([4096, 70], dtype=torch.int32), 16, 16, 4)
        cum = torch.tensor([0, 5, 6], dtype=torch.int32)  # FlashMLA's split accumulators at 32 heads x 512
        split_combine(
            torch.randn(8, 32, 512, generator=g),
            torch.randn(8, 32, generator=g),
            cum,
            torch.zeros(2, 32, 512, dtype=torch.bfloat16),
            132,
        )
        moe_align_blocks(torch.randint(0, 16, (40, 8), generator=g), 16, block=64)
        kv = torch.randn(8, 64, 2, 2, 32, generator=g)  # pages of 64, K | V, 2 KV heads of 32
        tables = [torch.arange(5), torch.arange(5, 6)]
        paged_gqa_attention_triton(torch.randn(2, 4, 32, generator=g), kv, [0, 1, 2], [300, 40], tables, 0.2, 2)
    launches = _ours(seen)
    kernels = {x.kernel for x in launches}
    want = {"_chunk_max_kernel", "_row_argmax_kernel", "_argmax_one_launch_kernel", "_router_partials_kernel"}
    want |= {"_even_blocks_plan_kernel"}
    want |= {"_split_combine_kernel"}
    want |= {"_block_counts_kernel", "_block_rows_kernel", "_block_place_kernel", "_merge_splits_kernel"}
    assert want <= kernels, sorted(want - kernels)
    assert compile_errors(launches) == []


def test_prefill_and_handoff_kernels_compile_for_the_h200():
    """The long-step kernels (the MoE prefill GEMMs, the q|k|v conv planes) and the handoff / fork copies, launched
    by their own tests' cases in bf16 (the TMA forms take descriptors: not compiled here)."""
    from kernels.moe.prefill import GemmTiles
    from tests.kernels import test_moe_prefill, test_page_copy, test_short_conv_planes, test_state_copy

    with record_launches() as seen:
        bf16 = torch.bfloat16
        test_moe_prefill.test_prefill_experts_match_the_definition(37, 8, 2, 64, 32, GemmTiles(16, 16, 32), bf16)
        test_short_conv_planes.test_planes_match_the_naive_conv_then_l2norm([300, 2, 65], [True, False, True], bf16, 16)
        test_page_copy.test_pack_unpack_roundtrip(3, "mla", 5, 17, bf16)
        test_state_copy.test_copy(3, [1, 2], [6, 2], [2, 1], 6, bf16)
    launches = _ours(seen)
    kernels = {x.kernel for x in launches}
    want = {
        "_gate_up_tiles_kernel",
        "_down_tiles_kernel",
        "_conv_planes_kernel",
        "_page_copy_kernel",
        "_copy_slots_kernel",
    }
    assert want <= kernels, sorted(kernels)
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


def test_bf16_dots_compile_for_the_tensor_cores_as_on_the_gpu():
    """The interpreter records a bf16 launch with its dot's operands upcast to fp32 (``dot_config``: DOT_F32,
    "ieee"); the GPU launches it on the tensor cores (DOT_F32 off, "tf32"), and that form is the one compiled:
    its PTX has MMA instructions, the fp32 launch's has none. A launch that already has the GPU's form is kept."""
    from kernels.moe.decode import _gate_up_kernel

    def launch(dtype: torch.dtype) -> Launch:
        x = torch.zeros(1, 64, dtype=dtype)
        ids = torch.zeros(4, dtype=torch.int64)
        w13, a = torch.zeros(8, 128, 64, dtype=dtype), torch.zeros(4, 64, dtype=dtype)
        args = (x, ids, ids, ids, ids, w13, a, 64, 64, 4096, 64, 8192, 64, 64)
        blocks = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, DOT_F32=True, PREC="ieee", COMPACT=False, USE_PDL=False)
        got = launch_of(_gate_up_kernel, args, {**blocks, "PAIR_ROWS": True, "num_warps": 4})
        assert got is not None
        return got

    bf16, fp32 = launch(torch.bfloat16), launch(torch.float32)
    as_dict = [{**dataclasses.asdict(x), "constexprs": list(x.constexprs)} for x in (bf16, fp32)]
    gpu_bf16, gpu_fp32 = (as_on_the_gpu(x) for x in as_dict)
    assert (gpu_bf16["DOT_F32"], gpu_bf16["PREC"]) == (False, "tf32")
    assert (gpu_fp32["DOT_F32"], gpu_fp32["PREC"]) == (False, "ieee")
    already = {**as_dict[0], "constexprs": [(k, {"DOT_F32": False}.get(k, v)) for k, v in bf16.constexprs]}
    assert as_on_the_gpu(already)["PREC"] == "ieee"  # not the interpreter's form: left as it is
    assert re.search(r"\b(w?gmma|mma)\.", ptx_of(bf16)) and not re.search(r"\b(w?gmma|mma)\.", ptx_of(fp32))
