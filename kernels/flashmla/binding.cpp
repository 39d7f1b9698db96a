// Tandem's binding of FlashMLA's dense MLA decode (sm90a, bf16) only: FlashMLA's own api.cpp also binds the
// sparse and sm100 kernels, which would multiply the build time for nothing Tandem calls.
#include <pybind11/pybind11.h>

#include "api/dense_decode.h"

// The split kernel alone, for Tandem's combine (kernels/flashmla/combine.py). FlashMLA's combine gives each query
// head one warp that walks the splits serially, one dependent load each, over 4 CTAs at batch 1 and 32 heads:
// 30 us a layer for one 32k sequence in 128 splits (docs/PERFORMANCE.md, twenty-ninth session). Same checks and
// split-kernel launch as dense_attn_decode_interface (api/dense_decode.h, MIT, (c) 2025 DeepSeek), for the case
// Tandem runs: one query per sequence, one latent head, bf16, a plan given (kernels/flashmla/plan.py).
// Returns (out [B, H, 512] bf16: written for the one-split sequences only, lse_accum [B + parts, H] fp32 (log2),
// out_accum [B + parts, H, 512] fp32); the caller combines the multi-split sequences into out.
static std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_decode_split_interface(
    const at::Tensor &q,                       // batch_size x 1 x num_heads x 576
    const at::Tensor &kcache,                  // num_blocks x 64 x 1 x 576
    const int head_size_v,
    const at::Tensor &seqlens_k,               // batch_size, int32
    const at::Tensor &block_table,             // batch_size x max_num_blocks_per_seq, int32
    const float softmax_scale,
    const at::Tensor &tile_scheduler_metadata, // num_sm_parts x (DecodingSchedMetaSize/4), int32
    const at::Tensor &num_splits               // batch_size + 1, int32
) {
    Arch arch = Arch();
    TORCH_CHECK(arch.is_sm90a(), "Dense decode MLA is only supported on SM90a architecture");
    TORCH_CHECK(q.dtype() == torch::kBFloat16, "q must be bf16 (the build is bf16 only)");
    TORCH_CHECK(kcache.dtype() == q.dtype(), "query and key must have the same dtype");
    TORCH_CHECK(seqlens_k.dtype() == torch::kInt32, "seqlens_k must have dtype int32");
    TORCH_CHECK(block_table.dtype() == torch::kInt32, "block_table must have dtype torch.int32");
    KU_CHECK_DTYPE(tile_scheduler_metadata, torch::kInt32);
    KU_CHECK_DTYPE(num_splits, torch::kInt32);
    KU_CHECK_DEVICE(q);
    KU_CHECK_DEVICE(kcache);
    KU_CHECK_DEVICE(seqlens_k);
    KU_CHECK_DEVICE(block_table);
    KU_CHECK_DEVICE(tile_scheduler_metadata);
    KU_CHECK_DEVICE(num_splits);
    TORCH_CHECK(q.stride(-1) == 1, "q must have contiguous last dimension");
    TORCH_CHECK(kcache.stride(-1) == 1, "kcache must have contiguous last dimension");
    KU_CHECK_CONTIGUOUS(seqlens_k);
    TORCH_CHECK(block_table.stride(-1) == 1, "block_table must have contiguous last dimension");
    KU_CHECK_CONTIGUOUS(tile_scheduler_metadata);
    KU_CHECK_CONTIGUOUS(num_splits);

    const int batch_size = q.size(0);
    const int num_heads_q = q.size(2);
    const int head_size_k = q.size(3);
    TORCH_CHECK(q.dim() == 4 && q.size(1) == 1, "one query per sequence: q must be batch_size x 1 x heads x 576");
    TORCH_CHECK(head_size_k == 576, "Only head_size_k == 576 is supported here");
    TORCH_CHECK(head_size_v == 512, "Only head_size_v == 512 is supported");
    TORCH_CHECK(kcache.dim() == 4 && kcache.size(2) == 1, "one latent head: kcache must be blocks x 64 x 1 x 576");
    const int max_num_blocks_per_seq = block_table.size(1);
    const int num_blocks = kcache.size(0);
    const int page_block_size = kcache.size(1);
    TORCH_CHECK(page_block_size == 64, "Currently page_block_size must be 64");
    TORCH_CHECK(batch_size > 0, "batch size must be positive");

    // One query and one latent head: dense_decode.h's q view / transpose / reshape is a plain reshape.
    const int q_seq_per_hk = num_heads_q;
    const int num_sm_parts = std::max(arch.num_sms / cutlass::ceil_div(num_heads_q, 64), 1);
    at::Tensor qv = q.reshape({batch_size, q_seq_per_hk, 1, head_size_k});
    KU_CHECK_SHAPE(kcache, num_blocks, page_block_size, 1, head_size_k);
    KU_CHECK_SHAPE(seqlens_k, batch_size);
    KU_CHECK_SHAPE(block_table, batch_size, max_num_blocks_per_seq);
    KU_CHECK_SHAPE(tile_scheduler_metadata, num_sm_parts, DecodingSchedMetaSize/sizeof(int));
    KU_CHECK_SHAPE(num_splits, batch_size+1);

    at::cuda::CUDAGuard device_guard{(char)q.get_device()};

    auto opts = q.options();
    at::Tensor out = torch::empty({batch_size, 1, q_seq_per_hk, head_size_v}, opts);
    at::Tensor lse = torch::empty({batch_size, 1, q_seq_per_hk}, opts.dtype(at::kFloat));

    DenseAttnDecodeParams params;
    params.b = batch_size;
    params.s_q = 1;
    params.q_seq_per_hk = q_seq_per_hk;
    params.seqlens_k_ptr = seqlens_k.data_ptr<int>();
    params.h_q = num_heads_q;
    params.h_k = 1;
    params.num_blocks = num_blocks;
    params.q_head_per_hk = num_heads_q;
    params.is_causal = false;
    params.d = head_size_k;
    params.d_v = head_size_v;
    params.scale_softmax = softmax_scale;
    params.scale_softmax_log2 = float(softmax_scale * M_LOG2E);
    params.q_ptr = qv.data_ptr();
    params.k_ptr = kcache.data_ptr();
    params.o_ptr = out.data_ptr();
    params.softmax_lse_ptr = lse.data_ptr<float>();
    params.q_batch_stride = qv.stride(0);
    params.k_batch_stride = kcache.stride(0);
    params.o_batch_stride = out.stride(0);
    params.q_row_stride = qv.stride(1);
    params.k_row_stride = kcache.stride(1);
    params.o_row_stride = out.stride(2);
    params.q_head_stride = qv.stride(2);
    params.k_head_stride = kcache.stride(2);
    params.o_head_stride = out.stride(1);
    params.block_table = block_table.data_ptr<int>();
    params.block_table_batch_stride = block_table.stride(0);
    params.page_block_size = page_block_size;
    params.tile_scheduler_metadata_ptr = (DecodingSchedMeta*)tile_scheduler_metadata.data_ptr();
    params.num_sm_parts = num_sm_parts;
    params.num_splits_ptr = num_splits.data_ptr<int>();

    const int total_num_splits = batch_size + num_sm_parts;
    at::Tensor lse_accum = torch::empty({total_num_splits, q_seq_per_hk}, opts.dtype(at::kFloat));
    at::Tensor out_accum = torch::empty({total_num_splits, q_seq_per_hk, head_size_v}, opts.dtype(at::kFloat));
    params.total_num_splits = total_num_splits;
    params.softmax_lseaccum_ptr = lse_accum.data_ptr<float>();
    params.oaccum_ptr = out_accum.data_ptr<float>();
    params.stream = at::cuda::getCurrentCUDAStream().stream();

    sm90::run_flash_splitkv_mla_kernel<cutlass::bfloat16_t>(params);
    return {out.view({batch_size, q_seq_per_hk, head_size_v}), lse_accum, out_accum};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashMLA dense decode (sm90a, bf16), built by kernels/flashmla/build.py";
    m.def("dense_decode_fwd", &dense_attn_decode_interface);
    m.def("dense_decode_split_fwd", &dense_decode_split_interface);
}
