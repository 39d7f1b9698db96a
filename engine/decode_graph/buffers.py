"""The static input buffers of padded decode steps, and how one step's requests are written into them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.decode_graph.meta import DecodeMeta
from engine.forward_batch import ForwardBatch
from engine.scheduler import ScheduledChunk


@dataclass(frozen=True)
class PadTargets:
    """Where padding rows point: a page and a KDA slot reserved for them (never a request's)."""

    page: int
    slot: int


class StaticDecodeBuffers:
    """Inputs of a decode step at the largest batch size; smaller graphs use leading views.

    Rows are written from one host staging tensor with one host-to-device copy (pinned on CUDA). Block
    tables have a host mirror updated incrementally: during decode a request's page list only grows, so a
    row that holds the same request as last step gets only its new pages.
    """

    def __init__(self, max_batch: int, max_pages: int, page_size: int, pad: PadTargets, device: torch.device) -> None:
        self.max_batch, self.max_pages, self.page_size, self.pad, self.device = (
            max_batch,
            max_pages,
            page_size,
            pad,
            device,
        )
        pin = device.type == "cuda"
        self.rows = torch.zeros(5, max_batch, dtype=torch.int64, device=device)  # ids, pos, kv row, ctx, slot
        self.rows_host = torch.zeros(5, max_batch, dtype=torch.int64, pin_memory=pin)
        self.context_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.state_slots = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_pages, dtype=torch.int32, device=device)
        self.tables_host = torch.zeros(max_batch, max_pages, dtype=torch.int32, pin_memory=pin)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.has_initial_state = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(max_batch, dtype=torch.int64, device=device)
        self._row_owner: list[tuple[str, int, int] | None] = [None] * max_batch  # (request id, preemptions, pages)

    def meta(self, bs: int, bucket: int) -> DecodeMeta:
        return DecodeMeta(
            batch_size=bs,
            max_context=bucket,
            context_lens=self.context_lens[:bs],
            block_tables=self.block_tables[:bs, : -(-bucket // self.page_size)],
            state_slots=self.state_slots[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            has_initial_state=self.has_initial_state[:bs],
        )

    def _table_row(self, i: int, pages: list[int] | None, key: tuple[str, int] | None) -> None:
        if pages is None:  # padding
            if self._row_owner[i] is not None:
                self._row_owner[i] = None
            self.tables_host[i, 0] = self.pad.page
            return
        owner = self._row_owner[i]
        have = owner[2] if owner is not None and owner[:2] == key and owner[2] <= len(pages) else 0
        if have and (int(self.tables_host[i, 0]) != pages[0] or int(self.tables_host[i, have - 1]) != pages[have - 1]):
            have = 0  # not the page list we mirrored (a reused request id): rewrite the row
        if have < len(pages):
            self.tables_host[i, have : len(pages)] = torch.tensor(pages[have:], dtype=torch.int32)
        self._row_owner[i] = (*key, len(pages))

    def fill(self, chunks: list[ScheduledChunk], bs: int, bucket: int) -> list[list[int]]:
        """Write the step's rows (padding after the real ones) to the device; returns the host rows
        [ids, positions, kv rows, context lens, slots] for the eager path's host lists."""
        ps, n = self.page_size, len(chunks)
        ids, pos, kv, ctx, slots = ([0] * bs for _ in range(5))
        n_pages = -(-bucket // ps)
        for i, c in enumerate(chunks):
            req, p = c.request, c.start
            n_prompt = len(req.prompt_token_ids)
            ids[i] = req.prompt_token_ids[p] if p < n_prompt else req.output_token_ids[p - n_prompt]
            pos[i], ctx[i] = p, p + 1
            kv[i] = req.page_ids[p // ps] * ps + p % ps
            slots[i] = req.slot_ids[0] if req.slot_ids else self.pad.slot
            used = -(-(p + 1) // ps)
            self._table_row(i, req.page_ids[:used], (req.request_id, req.num_preemptions))
        for i in range(n, bs):
            kv[i], ctx[i], slots[i] = self.pad.page * ps, 1, self.pad.slot
            self._table_row(i, None, None)
        self.rows_host[:, :bs] = torch.tensor([ids, pos, kv, ctx, slots], dtype=torch.int64)
        self.rows[:, :bs].copy_(self.rows_host[:, :bs], non_blocking=True)
        self.context_lens[:bs].copy_(self.rows[3, :bs])
        self.state_slots[:bs].copy_(self.rows[4, :bs])
        self.block_tables[:bs, :n_pages].copy_(self.tables_host[:bs, :n_pages], non_blocking=True)
        return [ids, pos, kv, ctx, slots]

    def batch(self, meta: DecodeMeta, host: list[list[int]] | None) -> ForwardBatch:
        """A ForwardBatch over the static views. Host lists (used only by the host reference backends) come
        from `host`, the rows `fill` returned; None for a captured graph, where nothing may read them."""
        bs = meta.batch_size
        ctx, slots = (host[3], host[4]) if host is not None else ([1] * bs, [0] * bs)
        tables = [self.block_tables[i, : -(-c // self.page_size)].to(torch.int64) for i, c in enumerate(ctx)]
        return ForwardBatch(
            input_ids=self.rows[0, :bs],
            positions=self.rows[1, :bs],
            query_start_loc=list(range(bs + 1)),
            context_lens=list(ctx),
            block_tables=tables if host is not None else [],
            slot_mapping=self.rows[2, :bs],
            state_slots=list(slots),
            has_initial_state=[True] * bs,
            logits_indices=self.logits_indices[:bs],
            decode_meta=meta,
        )
