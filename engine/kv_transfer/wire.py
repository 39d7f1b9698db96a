"""Handoff messages on the wire with their tensor payload copied once, not by protobuf.

Protobuf (upb) copies a ``bytes`` field when a message is built, serialized or parsed, and again on
every read of the field; for KV payloads those copies cost as much CPU as the gRPC transport itself.

- Sending: ``encode_chunk`` serializes a kv / state / aux_hidden message without its payload (a few dozen
  bytes) and appends the payload as the TensorBytes' last field: one copy, done by the producer on the
  engine thread; the prefill stream sends those bytes as they are (``add_prefill_servicer``).
- Receiving: ``parse_chunk`` locates ``TensorBytes.data`` in the received bytes, parses the message with
  that one field cut out, and returns the payload as a memoryview of the received bytes. Anything it does
  not recognise (other messages, repeated fields, malformed bytes) goes through protobuf's own parser, so
  the result always means what protobuf says the bytes mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import grpc

from tandem.rpc import common_pb2 as cpb
from tandem.rpc import prefill_pb2 as pb

# HandoffChunk's payload fields that hold a TensorBytes -> that TensorBytes' field number in them
_TENSOR_FIELD = {
    pb.HandoffChunk.KV_FIELD_NUMBER: pb.KVPagePart.TENSOR_FIELD_NUMBER,
    pb.HandoffChunk.STATE_FIELD_NUMBER: pb.StatePart.TENSOR_FIELD_NUMBER,
    pb.HandoffChunk.AUX_HIDDEN_FIELD_NUMBER: pb.AuxHidden.TENSOR_FIELD_NUMBER,
}
_DATA_FIELD = pb.TensorBytes.DATA_FIELD_NUMBER
_PREFILL = pb.DESCRIPTOR.services_by_name["Prefill"]
PREFILL_METHOD = f"/{_PREFILL.full_name}/{_PREFILL.methods_by_name['Prefill'].name}"
LANE_PULL_METHOD = f"/{_PREFILL.full_name}/PullLane"
_STAGE = pb.DESCRIPTOR.services_by_name["PrefillStage"]
STAGE_PULL_METHOD = f"/{_STAGE.full_name}/Pull"
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


@dataclass(frozen=True, slots=True)
class ReceivedChunk:
    """A received HandoffChunk whose tensor payload was left in the received bytes: ``chunk``'s
    TensorBytes.data is empty and ``data`` views the payload."""

    chunk: pb.HandoffChunk
    data: memoryview
    crc32: int | None = None
    """``data``'s CRC-32 where the receiving thread computed it while the bytes were in cache (socket lanes);
    None: the consumer computes it."""


class EncodedChunk(NamedTuple):
    """A producer's kv / state / aux_hidden message, serialized; the prefill stream sends ``wire`` as is."""

    wire: bytes
    kind: str  # the HandoffChunk payload field
    payload_bytes: int


@dataclass
class StreamCount:
    """What one handoff stream sent, for the totals its end marker carries (the consumer checks them)."""

    messages: int = 0
    payload: int = 0
    kv: int = 0
    state: int = 0

    def sent(self, msg: EncodedChunk | pb.HandoffChunk) -> bytes | pb.HandoffChunk:
        """Count ``msg``; returns what the stream sends for it (an encoded message's bytes as they are)."""
        self.messages += 1
        if isinstance(msg, EncodedChunk):
            self.payload += msg.payload_bytes
            self.kv += msg.kind == "kv"
            self.state += msg.kind == "state"
            return msg.wire
        return msg

    def end(self) -> pb.HandoffChunk:
        return pb.HandoffChunk(
            end=pb.HandoffEnd(
                num_messages=self.messages,
                payload_bytes=self.payload,
                num_kv_parts=self.kv,
                num_state_tensors=self.state,
            )
        )


class _Unusual(Exception):
    """Bytes the fast path does not handle; protobuf parses them (or reports them malformed)."""


def _varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            break
    raise _Unusual


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _find_len_field(buf: memoryview, pos: int, end: int, field: int) -> tuple[int, int, int, int]:
    """(tag start, length start, value start, value end) of the one length-delimited occurrence of
    ``field`` in [pos, end); _Unusual if it is missing, repeated, of another wire type, or malformed."""
    found = None
    while pos < end:
        tag_start = pos
        tag, pos = _varint(buf, pos, end)
        wire_type = tag & 7
        if wire_type == _VARINT:
            _, pos = _varint(buf, pos, end)
        elif wire_type == _I64:
            pos += 8
        elif wire_type == _I32:
            pos += 4
        elif wire_type == _LEN:
            len_start = pos
            n, pos = _varint(buf, pos, end)
            if tag >> 3 == field:
                if found is not None:
                    raise _Unusual  # protobuf would merge the two: let it
                found = (tag_start, len_start, pos, pos + n)
            pos += n
        else:
            raise _Unusual  # groups: not in this schema
        if tag >> 3 == field and wire_type != _LEN:
            raise _Unusual
    if pos != end or found is None:
        raise _Unusual
    return found


def encode_chunk(chunk: pb.HandoffChunk, data: memoryview | bytes) -> EncodedChunk:
    """``chunk`` (kv / state / aux_hidden, its TensorBytes without data) serialized with ``data`` as that
    TensorBytes' data. Protobuf parses the result as that message with that data."""
    small = chunk.SerializeToString()
    buf, end = memoryview(small), len(small)
    try:
        tag, part_len_start = _varint(buf, 0, end)
        part_len, part_start = _varint(buf, part_len_start, end)
        _, t_len_start, t_start, t_end = _find_len_field(buf, part_start, end, _TENSOR_FIELD[tag >> 3])
    except (_Unusual, KeyError):
        raise ValueError(f"not a tensor-carrying handoff message: {chunk}") from None
    kind = chunk.WhichOneof("payload")
    if not len(data):  # proto3 leaves an empty bytes field out
        return EncodedChunk(small, kind, 0)
    data_field = encode_varint((_DATA_FIELD << 3) | _LEN) + encode_varint(len(data))
    added = len(data_field) + len(data)
    new_tensor_len = encode_varint(t_end - t_start + added)
    new_part_len = encode_varint(part_len + added + len(new_tensor_len) - (t_start - t_len_start))
    wire = b"".join(
        (
            buf[:part_len_start],
            new_part_len,
            buf[part_start:t_len_start],
            new_tensor_len,
            buf[t_start:t_end],
            data_field,
            data,
            buf[t_end:end],
        )
    )
    return EncodedChunk(wire, kind, len(data))


def serialize_chunk(msg: pb.HandoffChunk | bytes) -> bytes:
    """A handoff stream's response serializer: producer messages (EncodedChunk.wire) go as they are."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def add_prefill_servicer(servicer: object, server: grpc.aio.Server) -> None:
    """prefill_pb2_grpc.add_PrefillServicer_to_server, except that the Prefill and PullLane streams also
    send bytes (EncodedChunk.wire) as they are."""
    handlers = {
        "Info": grpc.unary_unary_rpc_method_handler(
            servicer.Info,
            request_deserializer=cpb.WorkerInfoRequest.FromString,
            response_serializer=cpb.WorkerInfo.SerializeToString,
        ),
        "Prefill": grpc.unary_stream_rpc_method_handler(
            servicer.Prefill, request_deserializer=pb.PrefillRequest.FromString, response_serializer=serialize_chunk
        ),
        "PullLane": grpc.unary_stream_rpc_method_handler(
            servicer.PullLane, request_deserializer=pb.LanePullRequest.FromString, response_serializer=serialize_chunk
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_PREFILL.full_name, handlers),))
    server.add_registered_method_handlers(_PREFILL.full_name, handlers)


def _split(raw: bytes) -> ReceivedChunk:
    buf = memoryview(raw)
    end = len(buf)
    tag, part_len_start = _varint(buf, 0, end)
    outer_field = tag >> 3
    if tag & 7 != _LEN or outer_field not in _TENSOR_FIELD:
        raise _Unusual
    part_len, part_start = _varint(buf, part_len_start, end)
    if part_start + part_len != end:
        raise _Unusual  # more than the one payload field: protobuf decides what it means
    _, t_len_start, t_start, t_end = _find_len_field(buf, part_start, end, _TENSOR_FIELD[outer_field])
    d_tag, _, d_start, d_end = _find_len_field(buf, t_start, t_end, _DATA_FIELD)
    # cut the data field out and shorten the two enclosing lengths to match
    new_tensor_len = encode_varint(t_end - t_start - (d_end - d_tag))
    new_part_len = part_len - (d_end - d_tag) - (t_start - t_len_start) + len(new_tensor_len)
    stripped = b"".join(
        (
            buf[:part_len_start],
            encode_varint(new_part_len),
            buf[part_start:t_len_start],
            new_tensor_len,
            buf[t_start:d_tag],
            buf[d_end:end],
        )
    )
    return ReceivedChunk(pb.HandoffChunk.FromString(stripped), buf[d_start:d_end])


def prefill_call(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamMultiCallable:
    """Prefill/Prefill with the handoff messages parsed by ``parse_chunk`` (the generated stub's
    deserializer copies every payload)."""
    return channel.unary_stream(
        PREFILL_METHOD, request_serializer=pb.PrefillRequest.SerializeToString, response_deserializer=parse_chunk
    )


def stage_pull_call(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamMultiCallable:
    """PrefillStage/Pull (one pipeline stage's share of a handoff), parsed like the Prefill stream."""
    return channel.unary_stream(
        STAGE_PULL_METHOD, request_serializer=pb.StagePullRequest.SerializeToString, response_deserializer=parse_chunk
    )


def lane_pull_call(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamMultiCallable:
    """Prefill/PullLane (one more data stream of a handoff), parsed like the Prefill stream."""
    return channel.unary_stream(
        LANE_PULL_METHOD, request_serializer=pb.LanePullRequest.SerializeToString, response_deserializer=parse_chunk
    )


def parse_chunk(raw: bytes) -> pb.HandoffChunk | ReceivedChunk:
    """The gRPC response deserializer of the handoff stream. Raises protobuf's DecodeError on malformed
    bytes (grpc then hands the consumer None, which it refuses)."""
    try:
        return _split(raw)
    except _Unusual:
        return pb.HandoffChunk.FromString(raw)
