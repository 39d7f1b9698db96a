"""Consumer (decode worker side): verify every handoff message and write it into reserved blocks.

Nothing is used until ``finish()`` has checked that the stream is complete and consistent; on any
error the caller releases the reservation and the request is never decoded.

Streams may be taken on several threads (socket lanes place their messages on threads of their own): every
message is taken under one lock, and ``close()`` (before the reservation is released) waits out the message
being taken and refuses the rest, so no byte lands in pages that are no longer this request's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from engine.cache.tensors import CacheTensors
from engine.fingerprint import Fingerprint
from engine.kv_transfer.codec import HandoffError, PagedTarget, TensorAssembler
from engine.kv_transfer.wire import ReceivedChunk
from engine.model_config import ModelConfig
from engine.request import TokenLogprobs
from kernels.upload import upload
from tandem.rpc import common_pb2 as cpb
from tandem.rpc import prefill_pb2 as pb


@dataclass(frozen=True)
class HandoffResult:
    first_token: int
    first_logprobs: TokenLogprobs | None
    block_hashes: list[bytes]
    payload_bytes: int
    aux_hidden: dict[int, torch.Tensor] | None = None
    """Target taps at the last prompt position, by layer id (when the consumer asked for them)."""


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise HandoffError(f"unknown dtype {name!r}")
    return dt


def _byte_view(t: torch.Tensor) -> memoryview | None:
    """A writable flat byte view of a contiguous CPU tensor (pieces are copied straight into it); None
    for other tensors, which are assembled in a host buffer and copied in when complete."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    return memoryview(t.view(-1).view(torch.uint8).numpy())


def _page_bytes(pool: torch.Tensor) -> np.ndarray | None:
    """A CPU page pool as [pages, page_bytes] uint8 (kv parts are written straight into it); None for a
    device pool, whose parts are assembled on the host and copied in when complete."""
    if pool.device.type != "cpu" or not pool.is_contiguous():
        return None
    return pool.view(pool.shape[0], -1).view(torch.uint8).numpy()


def fingerprint_to_pb(f: Fingerprint) -> cpb.Fingerprint:
    return cpb.Fingerprint(
        digest=f.digest,
        model_digest=f.model_digest,
        tokenizer_digest=f.tokenizer_digest,
        dtype=f.dtype,
        page_size=f.page_size,
        cache_layout=f.cache_layout,
    )


def fingerprint_from_pb(f: pb.Fingerprint) -> Fingerprint:  # type: ignore[name-defined]
    return Fingerprint(f.model_digest, f.tokenizer_digest, f.dtype, f.page_size, f.cache_layout)


@dataclass
class _Tally:
    """What one stream delivered, checked against its end marker."""

    layers: frozenset[int] | None = None  # a stage stream's layers (None: the main stream or a lane)
    messages: int = 0
    payload: int = 0
    end: pb.HandoffEnd | None = None


class HandoffConsumer:
    def __init__(
        self,
        cfg: ModelConfig,
        cache: CacheTensors,
        fingerprint: Fingerprint,
        num_prompt_tokens: int,
        page_ids: list[int],
        slot_ids: list[int],
        max_lanes: int = 1,
    ) -> None:
        self.cfg = cfg
        self.max_lanes = max_lanes
        self.cache = cache
        self.fingerprint = fingerprint
        self.n = num_prompt_tokens
        self.page_ids = page_ids
        self.slot_ids = slot_ids
        self.page_size = cache.layout.page_size
        self.num_pages = -(-num_prompt_tokens // self.page_size)
        self.dtype = next(iter(cache.kv.values())).dtype if cache.kv else torch.float32
        self._parts: dict[tuple, TensorAssembler] = {}
        self._done: set[tuple] = set()
        self._kv_pages: set[tuple[int, int]] = set()  # (layer, page) of every kv part begun
        self._kv_pools = {layer: _page_bytes(t) for layer, t in cache.kv.items()}
        self._header = False
        self._first: pb.FirstToken | None = None
        self._hashes: list[bytes] = []
        self._main = _Tally()
        self._stages: dict[int, _Tally] = {}
        """A pipelined producer's other stages (announced in the header): stage -> its stream's tally."""
        self._lanes: dict[int, _Tally] = {}
        """Lanes 1.. of the prefill stream's share (announced in the header): lane -> its stream's tally."""
        self._cur = self._main  # the stream whose message is being taken
        self.stage_streams: list[pb.StageStream] = []
        self.data_endpoint = ""
        """Where lanes 1.. are pulled when the producer serves them on sockets (header.data_endpoint)."""
        self.num_kv_parts = 0
        self._aux: dict[int, torch.Tensor] | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._crc: int | None = None  # the message being taken: its payload's CRC where the receiver computed it

    def close(self) -> None:
        """No message is taken after this returns (one being taken on another thread is waited for)."""
        with self._lock:
            self._closed = True

    def _unpack(self, msg: pb.HandoffChunk | ReceivedChunk) -> tuple[pb.HandoffChunk, memoryview | None]:
        if self._closed:
            raise HandoffError("the handoff was closed (abandoned by the decode worker)")
        if isinstance(msg, ReceivedChunk):
            self._crc = msg.crc32
            return msg.chunk, msg.data
        self._crc = None
        return msg, None

    def accept(self, msg: pb.HandoffChunk | ReceivedChunk | None) -> HandoffResult | None:
        """Take one message; returns the result after a valid end marker. ``msg``: as parsed by protobuf,
        or by wire.parse_chunk (payload apart); None where gRPC could not deserialize it."""
        if msg is None:
            raise HandoffError("a handoff message could not be decoded")
        with self._lock:
            return self._accept_main(*self._unpack(msg))

    def _accept_main(self, msg: pb.HandoffChunk, data: memoryview | None) -> HandoffResult | None:
        which = msg.WhichOneof("payload")
        if which != "header" and not self._header:
            raise HandoffError(f"handoff began with {which!r}, expected the header")
        self._cur = self._main
        if which == "end":
            return self._end(self._main, msg.end, "the prefill stream")
        self._main.messages += 1
        if which in ("kv", "state") and self._stages:
            layer = msg.kv.layer if which == "kv" else msg.state.layer
            if any(layer in t.layers for t in self._stages.values()):
                raise HandoffError(f"the prefill stream sent layer {layer}, which its header gave to a stage stream")
        if which == "header":
            self._on_header(msg.header)
        elif which == "kv":
            self._on_kv(msg.kv, data)
        elif which == "state":
            self._on_state(msg.state, data)
        elif which == "block_hashes":
            self._hashes = list(msg.block_hashes.hashes)
        elif which == "first_token":
            self._first = msg.first_token
        elif which == "aux_hidden":
            self._on_aux(msg.aux_hidden, data)
        else:
            raise HandoffError(f"unknown handoff message {which!r}")
        return None

    def accept_stage(self, stage: int, msg: pb.HandoffChunk | ReceivedChunk | None) -> HandoffResult | None:
        """Take one message of a stage stream (kv / state of that stage's layers, then its end marker);
        returns the result when this completes the whole handoff."""
        tally = self._stages.get(stage)
        if tally is None:
            raise HandoffError(f"stage {stage} was not announced by the producer's header")
        return self._accept_side(tally, f"stage {stage}'s stream", msg)

    def accept_lane(self, lane: int, msg: pb.HandoffChunk | ReceivedChunk | None) -> HandoffResult | None:
        """Take one message of lane ``lane`` (PullLane: kv / state of the prefill stream's layers, then its
        end marker); returns the result when this completes the whole handoff."""
        tally = self._lanes.get(lane)
        if tally is None:
            raise HandoffError(f"lane {lane} was not announced by the producer's header")
        return self._accept_side(tally, f"lane {lane}", msg)

    def _accept_side(
        self, tally: _Tally, stream: str, msg: pb.HandoffChunk | ReceivedChunk | None
    ) -> HandoffResult | None:
        if msg is None:
            raise HandoffError(f"a message of {stream} could not be decoded")
        with self._lock:
            return self._accept_side_locked(tally, stream, *self._unpack(msg))

    def _accept_side_locked(
        self, tally: _Tally, stream: str, msg: pb.HandoffChunk, data: memoryview | None
    ) -> HandoffResult | None:
        which = msg.WhichOneof("payload")
        self._cur = tally
        if which == "end":
            return self._end(tally, msg.end, stream)
        if tally.end is not None:
            raise HandoffError(f"{stream} sent {which!r} after its end marker")
        part = msg.kv if which == "kv" else msg.state if which == "state" else None
        if part is None or not self._side_may_carry(tally, part.layer):
            what = f"layer {part.layer}" if part is not None else repr(which)
            share = f"its layers {sorted(tally.layers)}" if tally.layers is not None else "the prefill stream's share"
            raise HandoffError(f"{stream} sent {what}, outside {share}")
        tally.messages += 1
        if which == "kv":
            self._on_kv(msg.kv, data)
        else:
            self._on_state(msg.state, data)
        return None

    def _side_may_carry(self, tally: _Tally, layer: int) -> bool:
        if tally.layers is not None:  # a stage stream: its own layers
            return layer in tally.layers
        return not any(layer in t.layers for t in self._stages.values())  # a lane: the prefill stream's share

    def _end(self, tally: _Tally, end: pb.HandoffEnd, stream: str) -> HandoffResult | None:
        if tally.end is not None:
            raise HandoffError(f"{stream} sent a second end marker")
        if (end.num_messages, end.payload_bytes) != (tally.messages, tally.payload):
            raise HandoffError(
                f"{stream}'s end marker says {end.num_messages} messages / {end.payload_bytes} bytes, "
                f"received {tally.messages} / {tally.payload}"
            )
        tally.end = end
        if self._main.end is None or any(t.end is None for t in self._side_tallies()):
            return None  # another stream still runs
        return self._finish()

    def stream_ended(self, stage: int) -> bool:
        """Whether the stream of this stage (0: the prefill stream) delivered a valid end marker."""
        tally = self._main if stage == 0 else self._stages.get(stage)
        return tally is not None and tally.end is not None

    def lane_ended(self, lane: int) -> bool:
        tally = self._main if lane == 0 else self._lanes.get(lane)
        return tally is not None and tally.end is not None

    @property
    def lanes(self) -> int:
        """Data streams of the prefill stream's share, itself included (from the header)."""
        return len(self._lanes) + 1

    def _side_tallies(self) -> list[_Tally]:
        return [*self._stages.values(), *self._lanes.values()]

    @property
    def payload_bytes(self) -> int:
        return self._main.payload + sum(t.payload for t in self._side_tallies())

    def _on_header(self, h: pb.HandoffHeader) -> None:
        theirs = fingerprint_from_pb(h.producer_fingerprint)
        diffs = self.fingerprint.differences(theirs)
        if diffs:
            raise HandoffError("producer fingerprint differs from this consumer's: " + "; ".join(diffs))
        if h.num_prompt_tokens != self.n or h.page_size != self.page_size:
            raise HandoffError(
                f"header says {h.num_prompt_tokens} tokens / page size {h.page_size}; "
                f"expected {self.n} / {self.page_size}"
            )
        if list(h.attention_layers) != list(self.cfg.attention_layers) or list(h.kda_layers) != list(
            self.cfg.kda_layers
        ):
            raise HandoffError("producer's layer lists differ from this consumer's")
        seen: set[int] = set()
        for st in h.stage_streams:
            layers = frozenset(st.layers)
            if st.stage == 0 or st.stage in self._stages or not layers or layers & seen or not st.endpoint:
                raise HandoffError(f"header announces a bad stage stream: stage {st.stage} at {st.endpoint!r}")
            if not layers <= set(range(self.cfg.num_hidden_layers)):
                raise HandoffError(f"stage {st.stage}'s layers {sorted(layers)} are not this model's")
            seen |= layers
            self._stages[st.stage] = _Tally(layers)
        self.stage_streams = list(h.stage_streams)
        if h.lanes > self.max_lanes:
            raise HandoffError(f"header announces {h.lanes} lanes; this consumer asked for at most {self.max_lanes}")
        if h.data_endpoint and h.lanes < 2:
            raise HandoffError(f"header names a socket data plane ({h.data_endpoint}) but no lane to pull from it")
        self._lanes = {i: _Tally() for i in range(1, h.lanes)}
        self.data_endpoint = h.data_endpoint
        self._header = True

    def _on_kv(self, part: pb.KVPagePart, data: memoryview | None) -> None:
        """Tokens [page_index * page_size, + num_tokens) of one layer; whole pages, except the
        prompt's last one, which may be partial."""
        layer, p0, n = part.layer, part.page_index, part.num_tokens
        key = ("kv", layer, p0, n)
        asm = self._parts.get(key) or self._begin_kv(layer, p0, n)
        self._cur.payload += asm.add(part.tensor, data, self._crc)
        if asm.complete:
            if asm.buf is not None:  # assembled on the host (a device cache): into the pages now
                self._place_rows(layer, p0, n, asm.tensor())
            self._done.update(("kv", layer, p) for p in range(p0, p0 + -(-n // self.page_size)))
            self._complete(key)
            self.num_kv_parts += 1

    def _place_rows(self, layer: int, p0: int, n: int, rows: torch.Tensor) -> None:
        """Tokens [p0 * page_size, + n) into their reserved pages: the whole pages with one indexed copy
        (one host-to-device transfer, not one per page), a partial last page after them."""
        ps, kv = self.page_size, self.cache.kv[layer]
        full = n // ps
        if full:
            ids = upload(torch.tensor(self.page_ids[p0 : p0 + full], dtype=torch.int64), kv.device)
            kv.index_copy_(0, ids, upload(rows[: full * ps].view(full, ps, *rows.shape[1:]), kv.device))
        if n > full * ps:
            kv[self.page_ids[p0 + full], : n - full * ps] = rows[full * ps :]

    def _begin_kv(self, layer: int, p0: int, n: int) -> TensorAssembler:
        ps = self.page_size
        start = p0 * ps
        if layer not in self.cache.kv or n == 0 or start + n > self.n:
            raise HandoffError(f"kv part for layer {layer} tokens [{start}, {start + n}) is outside the request")
        if n % ps and start + n != self.n:
            raise HandoffError(f"kv layer {layer} page {p0}: {n} tokens is not whole pages and not the prompt's end")
        pages = range(p0, p0 + -(-n // ps))
        for p in pages:  # checked before any byte is written: no part overwrites another's pages
            if (layer, p) in self._kv_pages:
                raise HandoffError(f"kv layer {layer} page {p} received twice")
        self._kv_pages.update((layer, p) for p in pages)
        pool = self._kv_pools[layer]
        target = None
        if pool is not None:  # write into the reserved pages directly
            ids = np.asarray(self.page_ids[p0 : p0 + len(pages)], dtype=np.int64)
            target = PagedTarget(pool, ids, n * (pool.shape[1] // ps))
        what = f"kv layer {layer} pages from {p0}"
        asm = TensorAssembler(what, self.dtype, (n, *self.cfg.kv_entry_shape), pages=target)
        self._parts[("kv", layer, p0, n)] = asm
        return asm

    def _on_state(self, part: pb.StatePart, data: memoryview | None) -> None:
        layer = part.layer
        if layer not in self.cache.recurrent or part.kind not in (pb.RECURRENT, pb.CONV):
            raise HandoffError(f"state part for layer {layer} kind {part.kind} does not exist here")
        pool = self.cache.recurrent[layer] if part.kind == pb.RECURRENT else self.cache.conv[layer]
        key = ("state", layer, int(part.kind))
        asm = self._parts.get(key)
        if asm is None:
            if key in self._done:
                raise HandoffError(f"{pb.StateKind.Name(part.kind)} state layer {layer} received twice")
            flat = _byte_view(pool[self.slot_ids[0]])
            what = f"{pb.StateKind.Name(part.kind)} state layer {layer}"
            asm = self._parts[key] = TensorAssembler(
                what, pool.dtype, tuple(pool.shape[1:]), None if flat is None else [flat]
            )
        self._cur.payload += asm.add(part.tensor, data, self._crc)
        if asm.complete:
            if asm.buf is not None:
                pool[self.slot_ids[0]] = asm.tensor()
            self._complete(key)

    def _on_aux(self, part: pb.AuxHidden, data: memoryview | None) -> None:
        ids = list(part.layer_ids)
        hidden = self.cfg.hidden_size
        shape = (len(ids) * hidden,)
        asm = self._assembler(("aux",), "aux hidden states", shape, _dtype(part.tensor.dtype))
        self._cur.payload += asm.add(part.tensor, data, self._crc)
        if asm.complete:
            flat = asm.tensor().clone()
            self._aux = {layer: flat[j * hidden : (j + 1) * hidden] for j, layer in enumerate(ids)}
            self._complete(("aux",))

    def _assembler(self, key: tuple, what: str, shape: tuple[int, ...], dtype: torch.dtype) -> TensorAssembler:
        if key in self._done:
            raise HandoffError(f"{what} received twice")
        if key not in self._parts:
            self._parts[key] = TensorAssembler(what, dtype, shape)
        return self._parts[key]

    def _complete(self, key: tuple) -> None:
        del self._parts[key]
        self._done.add(key)

    def _finish(self) -> HandoffResult:
        missing = [
            f"kv layer {layer} page {p}"
            for layer in self.cfg.attention_layers
            for p in range(self.num_pages)
            if ("kv", layer, p) not in self._done
        ]
        missing += [
            f"{kind} state layer {layer}"
            for layer in self.cfg.kda_layers
            for kind, k in (("RECURRENT", pb.RECURRENT), ("CONV", pb.CONV))
            if ("state", layer, int(k)) not in self._done
        ]
        if missing or self._parts:
            raise HandoffError(f"handoff incomplete: missing {missing[:6]} ({len(missing)} in all)")
        if self._first is None:
            raise HandoffError("handoff has no first token")
        t = self._first.token
        lp = (
            TokenLogprobs(t.token_id, t.logprob, tuple((x.token_id, x.logprob) for x in t.top))
            if self._first.has_logprob
            else None
        )
        expected_hashes = self.n // self.page_size
        if len(self._hashes) != expected_hashes:
            raise HandoffError(f"{len(self._hashes)} block hashes, expected {expected_hashes}")
        return HandoffResult(t.token_id, lp, self._hashes, self.payload_bytes, self._aux)
