"""Producer (prefill worker side): a layer hook that emits each finished page and, on the prompt's
last chunk, each KDA layer's state, while the following layers still compute.

Data is copied out of the cache inside the hook, so the request's pages can be freed as soon as its
prefill step ends, whatever the consumer does next.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.cache.tensors import CacheTensors
from engine.forward_batch import ForwardBatch
from engine.kv_transfer.codec import tensor_pieces
from engine.kv_transfer.wire import EncodedChunk, encode_chunk
from engine.model_config import ModelConfig
from tandem.rpc import prefill_pb2 as pb

Sink = Callable[[EncodedChunk], None]


class HandoffProducer:
    def __init__(self, cfg: ModelConfig, cache: CacheTensors, page_size: int) -> None:
        self.cfg = cfg
        self.cache = cache
        self.page_size = page_size
        self._sinks: dict[str, tuple[Sink, int]] = {}
        self._next_page: dict[tuple[str, int], int] = {}
        """(request, layer) -> first page not sent yet; pages reused from the prefix cache are sent
        with the request's first computed chunk."""
        self._lock = threading.Lock()

    def register(self, request_id: str, sink: Sink, max_message_bytes: int) -> None:
        with self._lock:
            self._sinks[request_id] = (sink, max_message_bytes)

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self._sinks.pop(request_id, None)
            for key in [k for k in self._next_page if k[0] == request_id]:
                del self._next_page[key]

    def streams(self) -> dict[str, int]:
        """Registered requests -> their max message bytes (other pipeline stages stream theirs too)."""
        with self._lock:
            return {rid: max_bytes for rid, (_, max_bytes) in self._sinks.items()}

    def on_layer(self, layer: int, batch: ForwardBatch) -> None:
        kda = self.cfg.layer_kinds[layer] == "kda"
        ps = self.page_size
        for i, rid in enumerate(batch.request_ids):
            with self._lock:
                entry = self._sinks.get(rid)
            if entry is None:
                continue
            sink, max_bytes = entry
            end, last = batch.context_lens[i], batch.completes_prompt[i]
            if kda:
                if last:  # the state after the whole prompt
                    slot = batch.state_slots[i]
                    for kind, t in (
                        (pb.RECURRENT, self.cache.recurrent[layer][slot]),
                        (pb.CONV, self.cache.conv[layer][slot]),
                    ):
                        for piece, data in tensor_pieces(t, max_bytes):
                            part = pb.StatePart(layer=layer, kind=kind, tensor=piece)
                            sink(encode_chunk(pb.HandoffChunk(state=part), data))
                continue
            table = batch.block_tables[i]
            first = self._next_page.get((rid, layer), 0)
            ready = []
            for p in range(first, -(-end // ps)):
                if min(end - p * ps, ps) < ps and not last:
                    break  # still filling: sent once full, or with the prompt's last chunk
                ready.append(p)
            # consecutive ready pages travel together (fewer, larger messages), each message at most
            # max_bytes: split the run into groups of whole pages
            page_bytes = ps * self.cache.kv[layer][0, 0].numel() * self.cache.kv[layer].element_size()
            per_msg = max(1, max_bytes // page_bytes)
            for g in range(0, len(ready), per_msg):
                group = ready[g : g + per_msg]
                n = min(end - group[0] * ps, len(group) * ps)
                rows = self.cache.kv[layer][table[group[0] : group[-1] + 1]].flatten(0, 1)[:n]
                for piece, data in tensor_pieces(rows, max_bytes):
                    part = pb.KVPagePart(layer=layer, page_index=group[0], num_tokens=n, tensor=piece)
                    sink(encode_chunk(pb.HandoffChunk(kv=part), data))
            if ready:
                self._next_page[(rid, layer)] = ready[-1] + 1
