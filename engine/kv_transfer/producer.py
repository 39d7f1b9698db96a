"""Producer (prefill worker side): a layer hook that emits each finished page and, on the prompt's
last chunk, each KDA layer's state, while the following layers still compute.

Data is copied out of the cache inside the hook, so the request's pages can be freed as soon as its
prefill step ends, whatever the consumer does next.

On a GPU the hook must not wait for the GPU: a device-to-host copy made the host wait at every layer, so
the next layers' kernels were enqueued only after the copy and the encoding, and the transfer did not
overlap compute. There the hook enqueues the copy into pinned memory behind the layer's kernels and an
encoder thread waits for it, checksums and encodes the messages and hands them to the sink, in order. The
engine calls ``flush()`` before it reports the step's outputs, so a request's final output never overtakes
its messages. (``TANDEM_HANDOFF_ASYNC_COPIES=1`` / ``0`` forces it on / off; on the CPU it is off: the copy
is the work.)
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

import torch

from engine.cache.tensors import CacheTensors
from engine.forward_batch import ForwardBatch
from engine.kv_transfer.codec import tensor_pieces
from engine.kv_transfer.wire import EncodedChunk, encode_chunk
from engine.model_config import ModelConfig
from tandem.rpc import prefill_pb2 as pb

Sink = Callable[[EncodedChunk], None]
MakeChunk = Callable[[pb.TensorBytes], pb.HandoffChunk]


def _default_async(cache: CacheTensors) -> bool:
    forced = os.environ.get("TANDEM_HANDOFF_ASYNC_COPIES", "")
    if forced in ("0", "1"):
        return forced == "1"
    tensors = [*cache.kv.values(), *cache.recurrent.values()]
    return bool(tensors) and tensors[0].is_cuda


class HandoffProducer:
    def __init__(self, cfg: ModelConfig, cache: CacheTensors, page_size: int, async_copies: bool | None = None) -> None:
        self.cfg = cfg
        self.cache = cache
        self.page_size = page_size
        self.async_copies = _default_async(cache) if async_copies is None else async_copies
        self._jobs: queue.Queue = queue.Queue()
        self._encoder: threading.Thread | None = None
        self._error: BaseException | None = None
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
                        self._emit(t, _state_chunk(layer, kind), sink, max_bytes)
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
                self._emit(rows, _kv_chunk(layer, group[0], n), sink, max_bytes)
            if ready:
                self._next_page[(rid, layer)] = ready[-1] + 1

    # ---- encoding: inline, or on the encoder thread behind an asynchronous copy ------------------------------
    def _emit(self, t: torch.Tensor, make: MakeChunk, sink: Sink, max_bytes: int) -> None:
        if not self.async_copies:
            _encode(t, make, sink, max_bytes)
            return
        event = None
        if t.is_cuda:  # a snapshot in pinned memory, copied behind the layer's kernels
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:  # nothing rewrites these pages or this slot before flush(), which the step ends with
            host = t
        if self._encoder is None:
            self._encoder = threading.Thread(target=self._encode_loop, name="handoff-encoder", daemon=True)
            self._encoder.start()
        self._jobs.put((event, host, make, sink, max_bytes))

    def _encode_loop(self) -> None:
        while True:
            event, host, make, sink, max_bytes = self._jobs.get()
            try:
                if event is not None:
                    event.synchronize()
                _encode(host, make, sink, max_bytes)
            except BaseException as e:  # raised on the engine thread by flush()
                if self._error is None:
                    self._error = e
            finally:
                self._jobs.task_done()

    def flush(self) -> None:
        """Until every message of the steps so far has gone to its sink (the engine thread, after a step)."""
        if self.async_copies:
            self._jobs.join()
            if self._error is not None:
                err, self._error = self._error, None
                raise RuntimeError(f"encoding a handoff message failed: {err!r}") from err


def _encode(t: torch.Tensor, make: MakeChunk, sink: Sink, max_bytes: int) -> None:
    for piece, data in tensor_pieces(t, max_bytes):
        sink(encode_chunk(make(piece), data))


def _kv_chunk(layer: int, page_index: int, num_tokens: int) -> MakeChunk:
    def make(piece: pb.TensorBytes) -> pb.HandoffChunk:
        return pb.HandoffChunk(
            kv=pb.KVPagePart(layer=layer, page_index=page_index, num_tokens=num_tokens, tensor=piece)
        )

    return make


def _state_chunk(layer: int, kind: int) -> MakeChunk:
    def make(piece: pb.TensorBytes) -> pb.HandoffChunk:
        return pb.HandoffChunk(state=pb.StatePart(layer=layer, kind=kind, tensor=piece))

    return make
