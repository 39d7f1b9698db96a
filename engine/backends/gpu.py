"""GPU backends: Triton attention here; MoE in gpu_moe.py, KDA in gpu_kda.py.

Same interfaces and results as torch_ref.py (the contract); only speed differs. Per-step metadata (packed
block tables, work lists, slot tensors) is built on the first layer that sees a ForwardBatch and reused by
every later layer of that step: the backends remember the last batch object they saw (by identity).

Imports triton (and, lazily, fla) — only ``select_backends`` on a CUDA device imports this module.
"""

from __future__ import annotations

import torch

from engine.backends.base import AttentionBackend, MLADims, QKNormRope
from engine.backends.gpu_kda import GPUKDABackend, gpu_kda_backend
from engine.backends.gpu_moe import FOLD_SHARED_MAX_TOKENS, FUSED_ROUTE_MAX_ROWS, ROUTER_GEMV_MAX_ROWS, GPUMoEBackend
from engine.backends.gpu_static import static_attn_meta, static_mla_parts
from engine.backends.norm import TorchNormBackend
from engine.backends.per_step import PerStep
from engine.forward_batch import ForwardBatch, kv_write_fields
from kernels.env import env_switch
from kernels.paged_attention.latent_write import write_mla_latent_triton
from kernels.paged_attention.meta import pack_block_tables, plan_gqa
from kernels.paged_attention.mla import MLA_EXPAND_MIN_Q_LEN, plan_mla, run_mla
from kernels.paged_attention.qk_norm_rope import qk_norm_rope_write
from kernels.paged_attention.triton import attention_fwd
from kernels.triton_utils import is_interpreting

# FlashMLA's split plan made once a step and shared by the MLA layers (kernels/flashmla/decode.DecodeSchedule);
# TANDEM_FLASHMLA_SHARED_PLAN=0 plans in every layer, for A / B runs
FLASHMLA_SHARED_PLAN = env_switch("TANDEM_FLASHMLA_SHARED_PLAN", True)
# Qwen3's q / k norms, RoPE and the K | V write in one launch (kernels/paged_attention/qk_norm_rope.py);
# TANDEM_QK_NORM_ROPE=0 runs the model's ops, for A / B runs
QK_NORM_ROPE = env_switch("TANDEM_QK_NORM_ROPE", True)


def _kv_write_rows(slot_mapping: torch.Tensor) -> torch.Tensor | None:
    """What a batch builder sets on the host (``kv_write_fields``), for a batch built without it."""
    return kv_write_fields(slot_mapping.cpu(), slot_mapping.device).get("kv_write_rows")


class GPUAttentionBackend(AttentionBackend):
    """Paged GQA and MLA with the Triton kernel of kernels/paged_attention/triton.py.

    MLA: sequences with fewer than ``mla_expand_min_q_len`` query rows (decode, spec verify, short chunks)
    run in the weight-absorbed form over the latent pages; longer chunks run in the expanded form.
    """

    def __init__(self, mla_expand_min_q_len: int | None = MLA_EXPAND_MIN_Q_LEN) -> None:
        self.mla_expand_min_q_len = mla_expand_min_q_len
        self._step = PerStep()

    def block_tables(self, batch: ForwardBatch, device: torch.device) -> torch.Tensor:
        return self._step.get(batch, "tables", lambda: pack_block_tables(batch.block_tables, device))

    def write_kv(self, cache: torch.Tensor, batch: ForwardBatch, entries: torch.Tensor) -> None:
        if batch.decode_meta is not None:  # static decode: every row has a target (padding: the scratch page)
            cache.view(-1, *cache.shape[2:])[batch.slot_mapping] = entries.to(cache.dtype)
            return
        # rows with slot -1 reuse cached KV: the builder's host fields, else read once per step (a sync)
        keep = batch.kv_write_rows
        if keep is None and not batch.all_kv_written:
            keep = self._step.get(batch, "keep", lambda: _kv_write_rows(batch.slot_mapping))
        if keep is None:
            cache.view(-1, *cache.shape[2:])[batch.slot_mapping] = entries.to(cache.dtype)
        else:
            cache.view(-1, *cache.shape[2:])[batch.slot_mapping[keep]] = entries[keep].to(cache.dtype)

    def gqa_qk_norm_rope_write(
        self,
        cache: torch.Tensor,
        batch: ForwardBatch,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        qk: QKNormRope,
        norms: TorchNormBackend,
    ) -> torch.Tensor:
        """One launch (rows with slot -1 skipped on the device) where the shapes fit, else the model's ops."""
        fits = QK_NORM_ROPE and (q.is_cuda or is_interpreting()) and q.dtype == k.dtype == v.dtype == cache.dtype
        if not fits or any(x.stride(-1) != 1 for x in (q, k, v)) or not cache.is_contiguous():
            return super().gqa_qk_norm_rope_write(cache, batch, q, k, v, qk, norms)
        w = (qk.q_norm_weight, qk.k_norm_weight, qk.eps)
        return qk_norm_rope_write(q, k, v, *w, batch.positions, qk.inv_freq, cache, batch.slot_mapping)

    def write_mla_latent(
        self,
        cache: torch.Tensor,
        batch: ForwardBatch,
        kv_a: torch.Tensor,
        kv_lora_rank: int,
        norm_weight: torch.Tensor,
        eps: float,
        norms: TorchNormBackend,
    ) -> None:
        """One launch (norm, k_pe and the page scatter; slot -1 rows skipped on the device) instead of the
        contiguous copy, norm, concatenation and scatter of the model's form."""
        write_mla_latent_triton(cache, batch.slot_mapping, kv_a, norm_weight, eps, kv_lora_rank)

    def gqa(self, q: torch.Tensor, cache: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
        group, d = q.shape[1] // cache.shape[3], q.shape[-1]
        if batch.decode_meta is not None:
            meta = static_attn_meta(batch.decode_meta, group, d)
            return attention_fwd(q.contiguous(), cache[:, :, 0], cache[:, :, 1], meta, scale)
        meta = self._step.get(
            batch,
            ("gqa", group, d),
            lambda: plan_gqa(
                batch.query_start_loc, batch.context_lens, self.block_tables(batch, q.device), group, q.device, d
            ),
        )
        return attention_fwd(q.contiguous(), cache[:, :, 0], cache[:, :, 1], meta, scale)

    def mla(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        batch: ForwardBatch,
        kv_b_weight: torch.Tensor,
        dims: MLADims,
        scale: float,
    ) -> torch.Tensor:
        h, page_size = q.shape[1], cache.shape[1]
        if batch.decode_meta is not None:
            parts = static_mla_parts(batch.decode_meta, h, dims.kv_lora_rank)
        else:
            parts = self._plan_mla(batch, q, h, page_size, dims)
        return run_mla(
            q,  # may be a strided view (a packed projection's columns): run_mla copies it only where needed
            cache,
            parts,
            kv_b_weight,
            dims.kv_lora_rank,
            dims.qk_nope_head_dim,
            dims.v_head_dim,
            scale,
            schedules=self._step.get(batch, "mla_schedules", dict) if FLASHMLA_SHARED_PLAN else None,
        )

    def _plan_mla(self, batch: ForwardBatch, q: torch.Tensor, h: int, page_size: int, dims: MLADims) -> list:
        return self._step.get(
            batch,
            ("mla", h, page_size, dims.kv_lora_rank),
            lambda: plan_mla(
                batch.query_start_loc,
                batch.context_lens,
                self.block_tables(batch, q.device),
                h,
                page_size,
                dims.kv_lora_rank,
                q.device,
                self.mla_expand_min_q_len,
            ),
        )


__all__ = [
    "FOLD_SHARED_MAX_TOKENS",
    "FUSED_ROUTE_MAX_ROWS",
    "ROUTER_GEMV_MAX_ROWS",
    "GPUAttentionBackend",
    "GPUKDABackend",
    "GPUMoEBackend",
    "gpu_kda_backend",
]
