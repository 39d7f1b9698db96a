"""Handoff lanes: the consumer takes a handoff dealt round-robin over the prefill stream and lanes 1..n-1
in any interleaving, bit-exact, and refuses misrouted, unannounced, miscounted or unfinished lanes; the
producer's registry deals, ends, fails and expires lanes as engine/kv_transfer/lanes.py says."""

from __future__ import annotations

import asyncio
import itertools
import random

import grpc
import pytest
import torch

from engine.kv_transfer.codec import HandoffError
from engine.kv_transfer.consumer import HandoffConsumer
from engine.kv_transfer.lanes import Dealer, HandoffLanes, LaneRefused
from engine.kv_transfer.wire import EncodedChunk, StreamCount
from tandem.rpc import prefill_pb2 as pb
from tests.conftest import make_engine, random_prompts
from tests.test_kv_transfer import _handoff

LANES = 3


def _is_data(m: pb.HandoffChunk) -> bool:
    return m.HasField("kv") or m.HasField("state")


def _end(stream: list[pb.HandoffChunk]) -> pb.HandoffChunk:
    payload = sum(len(getattr(m, m.WhichOneof("payload")).tensor.data) for m in stream if _is_data(m))
    return pb.HandoffChunk(end=pb.HandoffEnd(num_messages=len(stream), payload_bytes=payload))


def _deal(msgs: list[pb.HandoffChunk], lanes: int) -> list[list[pb.HandoffChunk]]:
    """[prefill stream, lane 1, ...] as the producer deals them: data message k to lane k % lanes."""
    header = pb.HandoffChunk()
    header.CopyFrom(msgs[0])
    header.header.lanes = lanes
    streams: list[list[pb.HandoffChunk]] = [[header]] + [[] for _ in range(lanes - 1)]
    data = [m for m in msgs[1:-1] if _is_data(m)]
    for k, m in enumerate(data):
        streams[k % lanes].append(m)
    streams[0] += [m for m in msgs[1:-1] if not _is_data(m)]  # block hashes, first token
    return [s + [_end(s)] for s in streams]


@pytest.fixture(scope="module")
def handoff(tiny_models):
    model_dir = tiny_models["kimi_linear"]
    p_engine = make_engine(model_dir)
    prompt = random_prompts(1, [45], seed=8)[0]
    msgs, p_req, fp = _handoff(p_engine, prompt)
    return model_dir, p_engine, p_req, fp, len(prompt), _deal(msgs, LANES)


def _consumer(handoff, max_lanes: int = LANES):
    model_dir, _, _, fp, n, _ = handoff
    d_engine = make_engine(model_dir)
    res = d_engine.reserve_import("x", n)
    consumer = HandoffConsumer(d_engine.model_config, d_engine.cache, fp, n, res.page_ids, res.slot_ids, max_lanes)
    return d_engine, res, consumer


def _feed(consumer: HandoffConsumer, lane: int, m: pb.HandoffChunk):
    return consumer.accept(m) if lane == 0 else consumer.accept_lane(lane, m)


@pytest.mark.parametrize("order", ["in turn", "lanes first", "shuffled"])
def test_lanes_assemble_bit_exact(handoff, order):
    _, p_engine, p_req, _, n, streams = handoff
    assert all(any(_is_data(m) for m in s) for s in streams)  # every lane carries data in this handoff
    d_engine, res, consumer = _consumer(handoff)
    assert consumer.accept(streams[0][0]) is None and consumer.lanes == LANES
    tagged = [[(i, m) for m in s] for i, s in enumerate(streams)]
    tagged[0] = tagged[0][1:]
    if order == "in turn":
        seq = [x for group in itertools.zip_longest(*tagged) for x in group if x is not None]
    elif order == "lanes first":
        seq = [x for s in tagged[1:] for x in s] + tagged[0]
    else:  # each stream in its own order, the streams interleaved at random
        rng, queues, seq = random.Random(3), [list(s) for s in tagged], []
        while any(queues):
            seq.append(rng.choice([q for q in queues if q]).pop(0))
    results = [_feed(consumer, i, m) for i, m in seq]
    assert all(r is None for r in results[:-1]) and results[-1] is not None  # only the last end completes it
    assert all(consumer.lane_ended(i) for i in range(LANES))
    for layer, pages in p_engine.cache.kv.items():
        got = d_engine.cache.kv[layer][res.page_ids].flatten(0, 1)[:n]
        assert torch.equal(got, pages[p_req.page_ids].flatten(0, 1)[:n]), layer
    for layer in p_engine.cache.recurrent:
        assert torch.equal(
            d_engine.cache.recurrent[layer][res.slot_ids[0]], p_engine.cache.recurrent[layer][p_req.slot_ids[0]]
        )


def _refused(handoff, feed, match, max_lanes: int = LANES):
    streams = handoff[-1]
    _, _, consumer = _consumer(handoff, max_lanes)
    with pytest.raises(HandoffError, match=match):
        consumer.accept(streams[0][0])
        feed(consumer, streams)


def test_lane_carrying_anything_but_data_is_refused(handoff):
    first_token = next(m for m in handoff[-1][0] if m.HasField("first_token"))
    _refused(handoff, lambda c, s: c.accept_lane(1, first_token), "lane 1 sent 'first_token'")


def test_unannounced_lane_is_refused(handoff):
    _refused(handoff, lambda c, s: c.accept_lane(LANES, s[1][0]), f"lane {LANES} was not announced")


def test_more_lanes_than_asked_for_are_refused(handoff):
    _refused(handoff, lambda c, s: None, "announces 3 lanes; this consumer asked for at most 2", max_lanes=2)


def test_lane_end_marker_must_count_its_stream(handoff):
    def feed(c, s):
        for m in s[2][1:]:  # lane 2's first message lost
            c.accept_lane(2, m)

    _refused(handoff, feed, "lane 2's end marker says")


def test_a_lane_may_not_carry_a_stage_streams_layer(handoff):
    """With a pipelined producer, lanes carry the prefill stream's share only, never a stage's layers."""
    streams = handoff[-1]
    m = streams[1][0]
    layer = m.kv.layer if m.HasField("kv") else m.state.layer
    header = pb.HandoffChunk()
    header.CopyFrom(streams[0][0])
    header.header.stage_streams.add(stage=1, endpoint="127.0.0.1:1", layers=[layer])
    _, _, consumer = _consumer(handoff)
    consumer.accept(header)
    with pytest.raises(HandoffError, match="outside the prefill stream's share"):
        consumer.accept_lane(1, m)


def test_unfinished_lane_gives_no_result(handoff):
    streams = handoff[-1]
    _, _, consumer = _consumer(handoff)
    assert all(consumer.accept(m) is None for m in streams[0])  # the prefill stream alone is not the handoff
    assert all(consumer.accept_lane(1, m) is None for m in streams[1])
    for m in streams[2][:-1]:
        assert consumer.accept_lane(2, m) is None
    assert consumer.lane_ended(0) and consumer.lane_ended(1) and not consumer.lane_ended(2)
    assert consumer.accept_lane(2, streams[2][-1]) is not None


# ---- the producer's registry ------------------------------------------------------------------------------


def _chunk(i: int) -> EncodedChunk:
    return EncodedChunk(wire=bytes([i]), kind="kv" if i % 2 else "state", payload_bytes=10 + i)


async def _drain(lanes: HandoffLanes, rid: str, lane: int) -> list:
    """What the lane sends: each message's bytes, then the end marker."""
    return [x async for x in lanes.pull(rid, lane, StreamCount())]


def test_dealer_is_round_robin_and_lanes_end_with_their_totals():
    async def run():
        lanes = HandoffLanes(max_lanes=8, ttl_s=60)
        assert lanes.grant(0) == 1 and lanes.grant(3) == 3 and lanes.grant(99) == 8
        lane0: list[EncodedChunk] = []
        deal = lanes.open("r", 3, lane0.append)
        assert isinstance(deal, Dealer)
        for i in range(7):
            deal(_chunk(i))
        await asyncio.sleep(0)  # the hops to the loop run
        lanes.end("r")
        got1, got2 = await asyncio.gather(_drain(lanes, "r", 1), _drain(lanes, "r", 2))
        assert [c.wire[0] for c in lane0] == [0, 3, 6]
        assert [w[0] for w in got1[:-1]] == [1, 4] and [w[0] for w in got2[:-1]] == [2, 5]
        end = got1[-1].end
        assert (end.num_messages, end.payload_bytes, end.num_kv_parts, end.num_state_tensors) == (2, 11 + 14, 1, 1)
        assert lanes.live == 0  # every lane pulled to its end: nothing kept

    asyncio.run(run())


def test_one_lane_is_no_lanes():
    async def run():
        lanes = HandoffLanes(max_lanes=8, ttl_s=60)
        sink: list = []
        assert lanes.open("r", 1, sink.append) == sink.append and lanes.live == 0

    asyncio.run(run())


@pytest.mark.parametrize(
    "case, code",
    [
        ("unknown", grpc.StatusCode.NOT_FOUND),
        ("lane 0", grpc.StatusCode.INVALID_ARGUMENT),
        ("lane 3", grpc.StatusCode.INVALID_ARGUMENT),
        ("twice", grpc.StatusCode.FAILED_PRECONDITION),
    ],
)
def test_bad_pulls_are_refused_with_their_status(case, code):
    async def run():
        lanes = HandoffLanes(max_lanes=8, ttl_s=60)
        lanes.open("r", 3, lambda c: None)
        if case == "twice":
            first = asyncio.ensure_future(_drain(lanes, "r", 1))
            await asyncio.sleep(0)
        rid, lane = ("x", 1) if case == "unknown" else ("r", {"lane 0": 0, "lane 3": 3}.get(case, 1))
        with pytest.raises(LaneRefused) as err:
            await _drain(lanes, rid, lane)
        assert err.value.code == code, err.value
        if case == "twice":
            lanes.fail("r", "test over")
            with pytest.raises(LaneRefused):
                await first

    asyncio.run(run())


def test_a_failed_handoff_ends_lanes_being_pulled_and_drops_the_rest():
    async def run():
        lanes = HandoffLanes(max_lanes=8, ttl_s=60)
        lanes.open("r", 3, lambda c: None)
        pulling = asyncio.ensure_future(_drain(lanes, "r", 1))
        await asyncio.sleep(0)
        lanes.fail("r", "the prefill stream ended before the prefill did")
        with pytest.raises(LaneRefused, match="ended before the prefill did") as err:
            await asyncio.wait_for(pulling, 1)
        assert err.value.code == grpc.StatusCode.ABORTED
        assert lanes.live == 0
        with pytest.raises(LaneRefused) as err:  # lane 2 was never pulled: gone
            await _drain(lanes, "r", 2)
        assert err.value.code == grpc.StatusCode.NOT_FOUND

    asyncio.run(run())


def test_lanes_nobody_pulls_expire():
    async def run():
        lanes = HandoffLanes(max_lanes=8, ttl_s=0.05)
        deal = lanes.open("r", 2, lambda c: None)
        deal(_chunk(0))
        deal(_chunk(1))
        await asyncio.sleep(0)
        lanes.end("r")
        assert lanes.live == 1
        await asyncio.sleep(0.2)
        assert lanes.live == 0

    asyncio.run(run())
