"""The consumer with a pipelined producer's stage streams: the handoff split as a pp=2 prefill worker
sends it (stage 0's layers in the prefill stream, stage 1's in its own), accepted in any interleaving,
bit-exact; misrouted, unannounced, miscounted or unfinished stage streams are refused."""

from __future__ import annotations

import pytest
import torch

from engine.kv_transfer.codec import HandoffError
from engine.kv_transfer.consumer import HandoffConsumer
from tandem.rpc import prefill_pb2 as pb
from tests.conftest import make_engine, random_prompts
from tests.test_kv_transfer import _handoff

STAGE1 = (2, 3)  # the tiny Kimi-Linear's layers 2-3: one KDA, one MLA


def _layer(m: pb.HandoffChunk) -> int | None:
    return m.kv.layer if m.HasField("kv") else m.state.layer if m.HasField("state") else None


def _split(msgs: list[pb.HandoffChunk]) -> tuple[list[pb.HandoffChunk], list[pb.HandoffChunk]]:
    """(prefill stream, stage 1 stream) of a handoff as a pp=2 producer sends it."""
    main = [pb.HandoffChunk() for _ in range(1)]
    main[0].CopyFrom(msgs[0])
    main[0].header.stage_streams.add(stage=1, endpoint="127.0.0.1:1", layers=STAGE1)
    stage = [m for m in msgs[1:-1] if _layer(m) in STAGE1]
    main += [m for m in msgs[1:-1] if _layer(m) not in STAGE1]
    for stream in (main, stage):
        payload = sum(len(getattr(m, m.WhichOneof("payload")).tensor.data) for m in stream if _layer(m) is not None)
        stream.append(pb.HandoffChunk(end=pb.HandoffEnd(num_messages=len(stream), payload_bytes=payload)))
    return main, stage


@pytest.fixture(scope="module")
def handoff(tiny_models):
    model_dir = tiny_models["kimi_linear"]
    p_engine = make_engine(model_dir)
    prompt = random_prompts(1, [45], seed=8)[0]
    msgs, p_req, fp = _handoff(p_engine, prompt)
    return model_dir, p_engine, p_req, fp, len(prompt), *_split(msgs)


def _consumer(handoff):
    model_dir, _, _, fp, n, _, _ = handoff
    d_engine = make_engine(model_dir)
    res = d_engine.reserve_import("x", n)
    return d_engine, res, HandoffConsumer(d_engine.model_config, d_engine.cache, fp, n, res.page_ids, res.slot_ids)


@pytest.mark.parametrize("order", ["main first", "stage first", "interleaved"])
def test_stage_streams_assemble_bit_exact(handoff, order):
    _, p_engine, p_req, _, n, main, stage = handoff
    d_engine, res, consumer = _consumer(handoff)
    consumer.accept(main[0])  # the header announces the stage stream
    assert [s.stage for s in consumer.stage_streams] == [1]
    if order == "main first":
        seq = [(0, m) for m in main[1:]] + [(1, m) for m in stage]
    elif order == "stage first":
        seq = [(1, m) for m in stage] + [(0, m) for m in main[1:]]
    else:
        seq = [x for pair in zip([(0, m) for m in main[1:]], [(1, m) for m in stage], strict=False) for x in pair]
        seq += [(0, m) for m in main[1 + len(stage) :]] + [(1, m) for m in stage[len(main) - 1 :]]
    results = [consumer.accept(m) if s == 0 else consumer.accept_stage(1, m) for s, m in seq]
    assert all(r is None for r in results[:-1]) and results[-1] is not None  # only the last end completes it
    assert consumer.stream_ended(0) and consumer.stream_ended(1)
    for layer, pages in p_engine.cache.kv.items():
        got = d_engine.cache.kv[layer][res.page_ids].flatten(0, 1)[:n]
        assert torch.equal(got, pages[p_req.page_ids].flatten(0, 1)[:n]), layer
    for layer in p_engine.cache.recurrent:
        assert torch.equal(
            d_engine.cache.recurrent[layer][res.slot_ids[0]], p_engine.cache.recurrent[layer][p_req.slot_ids[0]]
        )


def _refused(handoff, feed, match):
    _, _, _, _, _, main, stage = handoff
    _, _, consumer = _consumer(handoff)
    consumer.accept(main[0])
    with pytest.raises(HandoffError, match=match):
        feed(consumer, main, stage)


def test_stage_layer_on_the_prefill_stream_is_refused(handoff):
    _refused(handoff, lambda c, main, stage: c.accept(stage[0]), "gave to a stage stream")


def test_stage_stream_with_another_stages_layer_is_refused(handoff):
    _refused(handoff, lambda c, main, stage: c.accept_stage(1, main[1]), "outside its layers")


def test_unannounced_stage_is_refused(handoff):
    _refused(handoff, lambda c, main, stage: c.accept_stage(2, stage[0]), "not announced")


def test_stage_end_marker_must_count_its_stream(handoff):
    def feed(c, main, stage):
        for m in stage[1:]:  # one message lost
            c.accept_stage(1, m)

    _refused(handoff, feed, "stage 1's stream's end marker says")


def test_unfinished_stage_stream_gives_no_result(handoff):
    _, _, _, _, _, main, stage = handoff
    _, _, consumer = _consumer(handoff)
    assert all(consumer.accept(m) is None for m in main)  # the prefill stream alone is not the handoff
    for m in stage[:-1]:
        assert consumer.accept_stage(1, m) is None
    assert consumer.stream_ended(0) and not consumer.stream_ended(1)
    assert consumer.accept_stage(1, stage[-1]) is not None


def test_bad_stage_announcements_are_refused(handoff):
    _, _, _, _, _, main, _ = handoff
    for stage, layers in ((0, (2,)), (1, ()), (1, (2, 99))):
        bad = pb.HandoffChunk()
        bad.CopyFrom(main[0])
        del bad.header.stage_streams[:]
        bad.header.stage_streams.add(stage=stage, endpoint="h:1", layers=layers)
        _, _, consumer = _consumer(handoff)
        with pytest.raises(HandoffError, match="stage"):
            consumer.accept(bad)
