"""Turns scheduled chunks into a ForwardBatch, runs the model, returns the logits to sample."""

from __future__ import annotations

import torch

from engine.cache.tensors import CacheTensors
from engine.decode_graph import DecodeGraphs
from engine.forward_batch import ForwardBatch
from engine.models.base import CausalLM
from engine.scheduler import ScheduledChunk


class ModelRunner:
    def __init__(self, model: CausalLM, cache: CacheTensors, device: torch.device, page_size: int) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.page_size = page_size
        self.decode_graphs: DecodeGraphs | None = None
        """Pure-decode steps through static padded buffers / CUDA graphs (EngineConfig.cuda_graphs)."""

    def prepare(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        qsl = [0]
        ctx, tables, slots, has_init, logits_idx = [], [], [], [], []
        rids, starts, completes, cks = [], [], [], []
        ps = self.page_size
        for c in chunks:
            req = c.request
            end = c.start + c.num_tokens
            known = end - len(c.drafts)
            ids.extend(req.all_token_ids[c.start : known])
            ids.extend(c.drafts)
            positions.extend(range(c.start, end))
            slot_mapping.extend(
                req.page_ids[p // ps] * ps + p % ps if p >= req.kv_cached_tokens else -1 for p in range(c.start, end)
            )
            qsl.append(qsl[-1] + c.num_tokens)
            ctx.append(end)
            tables.append(torch.tensor(req.page_ids, dtype=torch.int64, device=self.device))
            slots.append(req.slot_ids[0] if req.slot_ids else -1)
            has_init.append(c.start > 0)
            if c.samples:  # a verify step needs the logits at the last token and every draft
                logits_idx.extend(range(qsl[-1] - 1 - len(c.drafts), qsl[-1]))
            rids.append(req.request_id)
            starts.append(c.start)
            completes.append(c.samples)
            cks.append(c.checkpoints)

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=self.device)

        return ForwardBatch(
            input_ids=t(ids),
            positions=t(positions),
            query_start_loc=qsl,
            context_lens=ctx,
            block_tables=tables,
            slot_mapping=t(slot_mapping),
            state_slots=slots,
            has_initial_state=has_init,
            logits_indices=t(logits_idx),
            request_ids=rids,
            chunk_starts=starts,
            completes_prompt=completes,
            checkpoints=cks,
        )

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits [S, V] fp32 for the chunks that sample, in chunk order."""
        if self.decode_graphs is not None and self.decode_graphs.accepts(chunks):
            return self.decode_graphs.run(chunks)
        batch = self.prepare(chunks)
        hidden = self.model(batch, self.cache)
        return self.model.compute_logits(hidden[batch.logits_indices])
