"""The static input buffers of padded decode steps, and how one step's requests are written into them."""

from __future__ import annotations

import torch

from engine.decode_graph.meta import DecodeMeta
from engine.forward_batch import ForwardBatch
from engine.pad_targets import PadTargets
from engine.scheduler import ScheduledChunk

ROWS = 6
"""Host rows of a step: ids, positions, kv rows, context lens, KDA slots, and the input ids' gather index."""
ROW_GATHER = 5
"""Per row, where its input id is in the device words (``StaticDecodeBuffers._words``): ``max_batch + i`` (row 0 of
the rows: the host's id) or ``j`` (the previous step's greedy id of its row j, carried on the device)."""
INT32_ROWS = 2
"""The context lens and KDA slots again as int32 (what the attention and KDA kernels take), staged behind the rows:
converting them on the device took two launches a step."""


class _Staging:
    """Host side of one step's inputs: the rows and the step's block tables, packed behind them in one pinned
    buffer (one host-to-device copy), plus the block-table mirror and what each mirrored row holds.

    Copies to the device are stream-ordered (non-blocking from pinned memory), so a staging buffer must not
    be rewritten until its copy has run: with overlapped decode the next step is filled while the previous
    one may still be queued. Two buffers alternate; `ready` is recorded after a buffer's copy.
    """

    def __init__(self, max_batch: int, max_pages: int, pin: bool) -> None:
        self.rows_bytes = (ROWS * 8 + INT32_ROWS * 4) * max_batch
        self.buf = torch.zeros(self.rows_bytes + max_batch * max_pages * 4, dtype=torch.uint8, pin_memory=pin)
        # ids, positions, kv rows, context lens, slots, where each input id comes from (ROW_GATHER)
        self.rows = self.buf[: ROWS * max_batch * 8].view(torch.int64).view(ROWS, max_batch)
        # context lens, slots (int32)
        self.rows32 = self.buf[ROWS * max_batch * 8 : self.rows_bytes].view(torch.int32).view(INT32_ROWS, max_batch)
        self.packed = self.buf[self.rows_bytes :].view(torch.int32)
        """The step's [bs, pages] tables, contiguous: the layout of the graph's (bs, bucket) view."""
        self.tables = torch.zeros(max_batch, max_pages, dtype=torch.int32)
        self.owner: list[tuple[str, int, int, int, int] | None] = [None] * max_batch
        """Per row, what `tables` holds: (request id, preemptions, pages, first page, last page)."""
        self.ready = torch.cuda.Event() if pin else None

    def table_row(self, i: int, pages: list[int] | None, key: tuple[str, int] | None, pad_page: int) -> None:
        if pages is None:  # padding
            self.owner[i] = None
            self.tables[i, 0] = pad_page
            return
        owner = self.owner[i]
        have = owner[2] if owner is not None and owner[:2] == key and owner[2] <= len(pages) else 0
        if have and (owner[3] != pages[0] or owner[4] != pages[have - 1]):
            have = 0  # not the page list we mirrored (a reused request id): rewrite the row
        if have < len(pages):
            self.tables[i, have : len(pages)] = torch.tensor(pages[have:], dtype=torch.int32)
        self.owner[i] = (*key, len(pages), pages[0], pages[-1])


class StaticDecodeBuffers:
    """Inputs of a decode step at the largest batch size; smaller graphs use leading views.

    Rows and block tables are written from one host staging buffer with one host-to-device copy (pinned on
    CUDA): each extra copy between two graph replays cost ~5-8 us of the GPU's time on the H200, and a strided one
    (a column slice) is staged by torch through pageable memory plus a scatter kernel. The tables of a (batch,
    bucket) step are a contiguous [bs, pages] view at the start of one flat buffer, so the step's tables are one
    contiguous range. They have a host mirror updated incrementally: during decode a request's page list only
    grows, so a row that holds the same request as last time gets only its new pages. A row's input id may
    instead be *carried*: taken on the device from the previous step's greedy ids (overlapped decode,
    engine/overlap.py), when the host does not know it yet.

    What a step does on the device before and after its layers (``prepare``: the input ids' gather; ``sampled``:
    the greedy ids) is part of the captured graph: each op outside the graph
    cost ~2-3 us of launch gap besides its kernel on the H200, ~70 us between two steps in all
    (bench/decode_timeline.py).
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
        words = (1 + ROWS) * max_batch
        rows32 = words * 8 + INT32_ROWS * 4 * max_batch
        # [sampled | rows | rows32 | tables]: all but sampled written by one copy from the staging buffer
        self._dev = torch.zeros(rows32 + max_batch * max_pages * 4, dtype=torch.uint8, device=device)
        self._words = self._dev[: words * 8].view(torch.int64)
        """[sampled | rows]: the gather's source (ROW_GATHER)."""
        self.sampled = self._words[:max_batch]
        """[max_batch] int64: the last step's greedy ids (its logits' argmax), written inside the step."""
        self.rows = self._words[max_batch:].view(ROWS, max_batch)
        self.context_lens, self.state_slots = self._dev[words * 8 : rows32].view(torch.int32).view(INT32_ROWS, -1)
        self._tables = self._dev[rows32:].view(torch.int32)
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.has_initial_state = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(max_batch, dtype=torch.int64, device=device)
        self._staging = [_Staging(max_batch, max_pages, pin) for _ in range(2 if pin else 1)]
        self._next = 0

    def block_tables(self, bs: int, bucket: int) -> torch.Tensor:
        """[bs, bucket / page_size] int32, contiguous: the (bs, bucket) step's view of the tables."""
        n_pages = -(-bucket // self.page_size)
        return self._tables[: bs * n_pages].view(bs, n_pages)

    def meta(self, bs: int, bucket: int) -> DecodeMeta:
        return DecodeMeta(
            batch_size=bs,
            max_context=bucket,
            context_lens=self.context_lens[:bs],
            block_tables=self.block_tables(bs, bucket),
            state_slots=self.state_slots[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            has_initial_state=self.has_initial_state[:bs],
        )

    def fill(
        self, chunks: list[ScheduledChunk], bs: int, bucket: int, carried: list[int] | None = None
    ) -> list[list[int]]:
        """Write the step's rows (padding after the real ones) to the device; returns the host rows
        [ids, positions, kv rows, context lens, slots] for the eager path's host lists. Row i with
        carried[i] >= 0 takes its input id from the previous step's greedy ids, row carried[i] of ``sampled``
        (its host id is 0), when the step runs (``prepare``)."""
        stage = self._staging[self._next]
        self._next = (self._next + 1) % len(self._staging)
        if stage.ready is not None:
            stage.ready.synchronize()  # its last copies ran (long ago: two steps back)
        ps, n, pad, width = self.page_size, len(chunks), self.pad, self.max_batch
        ids, pos, kv, ctx, slots = ([0] * bs for _ in range(5))
        gather = list(range(width, width + bs))  # row 0 of the rows: the host's id
        n_pages = -(-bucket // ps)
        for i, c in enumerate(chunks):
            req, p = c.request, c.start
            if carried is not None and carried[i] >= 0:
                gather[i] = carried[i]
            else:
                n_prompt = len(req.prompt_token_ids)
                ids[i] = req.prompt_token_ids[p] if p < n_prompt else req.output_token_ids[p - n_prompt]
            pos[i], ctx[i] = p, p + 1
            kv[i] = req.page_ids[p // ps] * ps + p % ps
            slots[i] = req.slot_ids[0] if req.slot_ids else pad.slot
            used = -(-(p + 1) // ps)
            stage.table_row(i, req.page_ids[:used], (req.request_id, req.num_preemptions), pad.page)
        for i in range(n, bs):
            kv[i], ctx[i], slots[i] = pad.page * ps, 1, pad.slot
            stage.table_row(i, None, None, pad.page)
        stage.rows[:, :bs] = torch.tensor([ids, pos, kv, ctx, slots, gather], dtype=torch.int64)
        stage.rows32[:, :bs] = torch.tensor([ctx, slots], dtype=torch.int32)
        stage.packed[: bs * n_pages].view(bs, n_pages).copy_(stage.tables[:bs, :n_pages])
        # the whole rows block (the columns past bs are not read by this step) and the packed tables: one copy
        nbytes = stage.rows_bytes + bs * n_pages * 4
        self._dev[width * 8 : width * 8 + nbytes].copy_(stage.buf[:nbytes], non_blocking=True)
        if stage.ready is not None:
            stage.ready.record()
        return [ids, pos, kv, ctx, slots]

    def prepare(self, bs: int) -> None:
        """The step's device-side inputs, run as the step's first op (inside its graph): each input id from the
        host's row or the previous step's greedy ids (one gather). The int32 lengths and slots came with the copy."""
        torch.index_select(self._words, 0, self.rows[ROW_GATHER, :bs], out=self.input_ids[:bs])

    def batch(self, meta: DecodeMeta, host: list[list[int]] | None) -> ForwardBatch:
        """A ForwardBatch over the static views. Host lists (used only by the host reference backends) come
        from `host`, the rows `fill` returned; None for a captured graph, where nothing may read them."""
        bs = meta.batch_size
        ctx, slots = (host[3], host[4]) if host is not None else ([1] * bs, [0] * bs)
        tables = [meta.block_tables[i, : -(-c // self.page_size)].to(torch.int64) for i, c in enumerate(ctx)]
        return ForwardBatch(
            input_ids=self.input_ids[:bs],
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
