"""The handoff wire path: encode_chunk / parse_chunk agree with protobuf, the codec's CRC is zlib's,
and the assembler writes pieces into scattered destinations and refuses overlaps."""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from google.protobuf.message import DecodeError

from engine.kv_transfer.codec import HandoffError, TensorAssembler, crc32, tensor_pieces
from engine.kv_transfer.wire import ReceivedChunk, encode_chunk, parse_chunk
from tandem.rpc import prefill_pb2 as pb


def _tensor(n: int) -> pb.TensorBytes:
    return pb.TensorBytes(dtype="bfloat16", shape=[n // 2], offset=7, total_bytes=1 << 33, crc32=0xFFFFFFFF)


def _messages(n: int) -> list[pb.HandoffChunk]:
    """One of each tensor-carrying message, their TensorBytes without data."""
    return [
        pb.HandoffChunk(kv=pb.KVPagePart(layer=300, page_index=1 << 20, num_tokens=16, tensor=_tensor(n))),
        pb.HandoffChunk(state=pb.StatePart(layer=2, kind=pb.CONV, tensor=_tensor(n))),
        pb.HandoffChunk(aux_hidden=pb.AuxHidden(layer_ids=[-1, 5], tensor=_tensor(n))),
    ]


# sizes around the varint length boundaries of the data, the TensorBytes and the part
@pytest.mark.parametrize("n", [1, 60, 127, 128, 200, 16383, 16384, 1 << 20])
def test_encode_and_parse_agree_with_protobuf(n):
    data = os.urandom(n)
    for msg in _messages(n):
        enc = encode_chunk(msg, memoryview(data))
        full = pb.HandoffChunk()
        full.CopyFrom(msg)
        getattr(full, full.WhichOneof("payload")).tensor.data = data
        assert pb.HandoffChunk.FromString(enc.wire) == full  # protobuf reads what the producer sends
        assert (enc.kind, enc.payload_bytes) == (msg.WhichOneof("payload"), n)
        for wire in (enc.wire, full.SerializeToString()):  # ours and protobuf's field order
            got = parse_chunk(wire)
            assert isinstance(got, ReceivedChunk)
            assert got.chunk == msg and bytes(got.data) == data


def test_parse_falls_back_to_protobuf_where_the_fast_path_does_not_apply():
    header = pb.HandoffChunk(header=pb.HandoffHeader(num_prompt_tokens=5, page_size=16))
    assert parse_chunk(header.SerializeToString()) == header
    empty = _messages(0)[0]  # proto3 leaves empty data out
    assert parse_chunk(empty.SerializeToString()) == empty
    # the same field twice: protobuf merges the two kv parts, data included (last one wins)
    a, b = _messages(4)[0], _messages(4)[0]
    a.kv.tensor.data, b.kv.tensor.data, b.kv.layer = b"aaaa", b"bbbb", 9
    twice = a.SerializeToString() + b.SerializeToString()
    assert parse_chunk(twice) == pb.HandoffChunk.FromString(twice)
    assert parse_chunk(twice).kv.tensor.data == b"bbbb" and parse_chunk(twice).kv.layer == 9


def test_parse_refuses_malformed_bytes():
    msg = _messages(64)[0]
    msg.kv.tensor.data = os.urandom(64)
    wire = msg.SerializeToString()
    with pytest.raises(DecodeError):
        parse_chunk(wire[:-10])  # truncated inside the payload


def test_encode_refuses_a_message_without_tensor():
    with pytest.raises(ValueError, match="not a tensor-carrying"):
        encode_chunk(pb.HandoffChunk(end=pb.HandoffEnd(num_messages=3)), b"xx")


def test_crc32_is_zlibs():
    data = os.urandom(100_003)
    assert crc32(data) == zlib.crc32(data)
    assert crc32(memoryview(data)[5:70_000]) == zlib.crc32(data[5:70_000])


def test_assembler_scatters_pieces_into_segments():
    t = torch.randn(6, 10).to(torch.bfloat16)  # 120 bytes, sent in 17-byte pieces
    dest = bytearray(200)
    view = memoryview(dest)
    segments = [view[100:140], view[0:30], view[150:200]]  # 40 + 30 + 50 bytes, out of order
    asm = TensorAssembler("t", torch.bfloat16, (6, 10), segments)
    for piece, data in reversed(list(tensor_pieces(t, 17))):
        asm.add(piece, data)
    assert asm.complete
    raw = t.view(torch.uint8).reshape(-1).numpy().tobytes()
    assert bytes(dest[100:140] + dest[0:30] + dest[150:200]) == raw
    with pytest.raises(ValueError, match="segments hold"):
        TensorAssembler("t", torch.bfloat16, (6, 10), segments[:2])


def test_assembler_refuses_overlaps_and_corruption_before_writing():
    t = torch.arange(40, dtype=torch.float32)  # 160 bytes
    (p0, d0), (p1, d1), _ = tensor_pieces(t, 64)
    asm = TensorAssembler("t", torch.float32, (40,))
    asm.add(p0, d0)
    shifted = pb.TensorBytes()
    shifted.CopyFrom(p1)
    shifted.offset = 32  # [32, 96) overlaps [0, 64)
    shifted.crc32 = crc32(d1)
    with pytest.raises(HandoffError, match="overlaps"):
        asm.add(shifted, d1)
    with pytest.raises(HandoffError, match="received twice"):
        asm.add(p0, d0)
    bad = bytearray(d1)
    bad[3] ^= 1
    with pytest.raises(HandoffError, match="checksum mismatch"):
        asm.add(p1, bytes(bad))
    assert asm.received == 64 and bytes(asm.buf[64:]) == bytes(96)  # nothing of the refused pieces written
