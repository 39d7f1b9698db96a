"""Turns scheduled chunks into a ForwardBatch, runs the model, returns the logits to sample."""

from __future__ import annotations

import numpy as np
import torch

from engine.cache.tensors import CacheTensors
from engine.decode_graph import DecodeGraphs
from engine.forward_batch import ForwardBatch, kv_write_fields
from engine.models.base import CausalLM
from engine.prefill_graph import PrefillGraphs
from engine.scheduler import ScheduledChunk
from engine.step_rows import LONG_CHUNK, StepRows, int64_tensor
from kernels.upload import PinnedStaging


class ModelRunner:
    def __init__(self, model: CausalLM, cache: CacheTensors, device: torch.device, page_size: int) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.page_size = page_size
        self.decode_graphs: DecodeGraphs | None = None
        """Pure-decode steps through static padded buffers / CUDA graphs (EngineConfig.cuda_graphs)."""
        self.staging = PinnedStaging(device)
        self.prefill_graphs: PrefillGraphs | None = None
        """The other steps as piecewise CUDA graphs over token buckets (EngineConfig.prefill_graph_max_tokens)."""

    def prepare(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        rows = StepRows(self.page_size)
        qsl = [0]
        ctx, tables, slots, has_init, logits_idx = [], [], [], [], []
        rids, starts, completes, cks = [], [], [], []
        for c in chunks:
            req = c.request
            end = c.start + c.num_tokens
            known = end - len(c.drafts)
            pages = int64_tensor(req.page_ids)  # numpy-backed
            if not c.drafts and known <= len(req.prompt_token_ids) and c.num_tokens >= LONG_CHUNK:
                # one C copy (~5 us for 8k), no per-token conversion; a copy so the step's tensors never alias the
                # request's prompt (on the host they are used as is)
                ids = req.prompt_array()[c.start : known].copy()
            else:
                ids = req.all_token_ids[c.start : known] + list(c.drafts)
            rows.add(ids, c.start, end, req.page_ids, pages, req.kv_cached_tokens)
            qsl.append(qsl[-1] + c.num_tokens)
            ctx.append(end)
            tables.append(pages.numpy())
            slots.append(req.slot_ids[0] if req.slot_ids else -1)
            has_init.append(c.start > 0)
            if c.samples:  # a verify step needs the logits at the last token and every draft
                logits_idx.extend(range(qsl[-1] - 1 - len(c.drafts), qsl[-1]))
            rids.append(req.request_id)
            starts.append(c.start)
            completes.append(c.samples)
            cks.append(c.checkpoints)
        host_ids, host_positions, host_slots = rows.tensors()
        # one copy for the rows, the page tables and the logits rows (kernels/upload.PinnedStaging)
        ids, positions, slot_mapping, logits_rows, *tables = self.staging.upload(
            [host_ids.numpy(), host_positions.numpy(), host_slots.numpy(), np.asarray(logits_idx, np.int64), *tables]
        )
        return ForwardBatch(
            input_ids=ids,
            positions=positions,
            query_start_loc=qsl,
            context_lens=ctx,
            block_tables=tables,
            slot_mapping=slot_mapping,
            state_slots=slots,
            has_initial_state=has_init,
            logits_indices=logits_rows,
            request_ids=rids,
            chunk_starts=starts,
            completes_prompt=completes,
            checkpoints=cks,
            **kv_write_fields(host_slots, self.device),
        )

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits [S, V] fp32 for the chunks that sample, in chunk order."""
        if self.decode_graphs is not None and self.decode_graphs.accepts(chunks):
            return self.decode_graphs.run(chunks).float()
        batch = self.prepare(chunks)
        if self.prefill_graphs is not None and self.prefill_graphs.accepts(chunks):
            hidden = self.prefill_graphs.run(batch)
        else:
            hidden = self.model(batch, self.cache)
        return self.model.compute_logits(hidden[batch.logits_indices])
