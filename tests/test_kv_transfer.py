"""The handoff codec, producer and consumer in one process: bit-exact state, chunking, refusal."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.block_hash import block_hashes, namespace
from engine.fingerprint import compute_fingerprint
from engine.kv_transfer import consumer as consumer_mod
from engine.kv_transfer.codec import HandoffError, PagedTarget, TensorAssembler, tensor_pieces
from engine.kv_transfer.consumer import HandoffConsumer, fingerprint_to_pb
from engine.kv_transfer.producer import HandoffProducer
from engine.kv_transfer.wire import parse_chunk
from engine.sampling_params import SamplingParams
from tandem.rpc import prefill_pb2 as pb
from tests.conftest import make_engine, random_prompts

MAX_BYTES = 300  # tiny, so every tensor is split into several messages


def _handoff(engine, prompt, async_copies: bool = False):
    """Run a prefill on `engine` and collect the handoff messages (as the prefill service does)."""
    cfg = engine.model_config
    fp = compute_fingerprint(engine.config.model, cfg, engine.dtype, engine.config.page_size)
    producer = HandoffProducer(cfg, engine.cache, engine.config.page_size, async_copies=async_copies)
    engine.model.layer_hooks.append(producer.on_layer)
    engine.before_output_hooks.append(producer.flush)
    msgs = [
        pb.HandoffChunk(
            header=pb.HandoffHeader(
                producer_fingerprint=fingerprint_to_pb(fp),
                num_prompt_tokens=len(prompt),
                page_size=engine.config.page_size,
                attention_layers=list(cfg.attention_layers),
                kda_layers=list(cfg.kda_layers),
            )
        )
    ]
    producer.register("r", lambda chunk: msgs.append(pb.HandoffChunk.FromString(chunk.wire)), MAX_BYTES)
    engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0), request_id="r")
    while len(engine.scheduler.running[0].output_token_ids) < 1 if engine.scheduler.running else True:
        engine.step()
        if engine.scheduler.running and engine.scheduler.running[0].output_token_ids:
            break
    req = engine.scheduler.running[0]
    producer.unregister("r")
    ns = namespace(fp.model_digest)
    msgs.append(pb.HandoffChunk(block_hashes=pb.BlockHashes(hashes=block_hashes(ns, prompt, engine.config.page_size))))
    first = pb.FirstToken()
    first.token.token_id = req.output_token_ids[0]
    msgs.append(pb.HandoffChunk(first_token=first))
    payload = sum(
        len(getattr(m, m.WhichOneof("payload")).tensor.data) for m in msgs if m.HasField("kv") or m.HasField("state")
    )
    msgs.append(pb.HandoffChunk(end=pb.HandoffEnd(num_messages=len(msgs), payload_bytes=payload)))
    return msgs, req, fp


@pytest.mark.parametrize(
    ("prompt_len", "page_size"), [(5, 16), (16, 16), (45, 16), (45, 64), (130, 64)], ids=lambda v: str(v)
)
@pytest.mark.parametrize("via", ["protobuf", "wire", "host buffer", "encoder thread"])
def test_handoff_roundtrip_is_bit_exact(model_dir, prompt_len, page_size, via, monkeypatch):
    """via: messages parsed by protobuf, or by wire.parse_chunk (as the decode service does), or with
    pieces assembled in a host buffer first (how a device cache is filled), or encoded on the producer's
    encoder thread from snapshots (as on a GPU prefill worker), flushed before the step's output."""
    if via == "host buffer":
        monkeypatch.setattr(consumer_mod, "_byte_view", lambda t: None)
    # chunked: pages finish across chunks (pages of 64: the GPU decode's FlashMLA pages)
    p_engine = make_engine(model_dir, max_num_batched_tokens=7 if page_size == 16 else 50, page_size=page_size)
    d_engine = make_engine(model_dir, page_size=page_size)
    prompt = random_prompts(1, [prompt_len], seed=3)[0]
    msgs, p_req, fp = _handoff(p_engine, prompt, async_copies=via == "encoder thread")
    assert all(len(m.SerializeToString()) < MAX_BYTES + 512 for m in msgs)
    res = d_engine.reserve_import("x", prompt_len)
    consumer = HandoffConsumer(d_engine.model_config, d_engine.cache, fp, prompt_len, res.page_ids, res.slot_ids)
    out = None
    for m in msgs:
        out = consumer.accept(parse_chunk(m.SerializeToString()) if via == "wire" else m) or out
    assert out is not None and out.first_token == p_req.output_token_ids[0]
    ps = p_engine.config.page_size
    for layer, pages in p_engine.cache.kv.items():
        got = d_engine.cache.kv[layer][res.page_ids].flatten(0, 1)[:prompt_len]
        want = pages[p_req.page_ids].flatten(0, 1)[:prompt_len]
        assert torch.equal(got, want), f"layer {layer}"
    for layer in p_engine.cache.recurrent:
        for pool_p, pool_d in (
            (p_engine.cache.recurrent, d_engine.cache.recurrent),
            (p_engine.cache.conv, d_engine.cache.conv),
        ):
            assert torch.equal(pool_d[layer][res.slot_ids[0]], pool_p[layer][p_req.slot_ids[0]])
    assert len(out.block_hashes) == prompt_len // ps


def test_consumer_refuses_corruption_duplicates_and_truncation(tiny_models):
    model_dir = tiny_models["kimi_linear"]
    p_engine, d_engine = make_engine(model_dir), make_engine(model_dir)
    prompt = random_prompts(1, [40], seed=4)[0]
    msgs, _, fp = _handoff(p_engine, prompt)

    def feed(seq):
        res = d_engine.reserve_import(f"x{len(d_engine._reservations)}-{id(seq)}", len(prompt))
        c = HandoffConsumer(d_engine.model_config, d_engine.cache, fp, len(prompt), res.page_ids, res.slot_ids)
        try:
            for m in seq:
                c.accept(m)
        finally:
            d_engine.release_import(res)

    ps = d_engine.config.page_size
    i_data = next(i for i, m in enumerate(msgs) if m.HasField("state"))
    flipped = [pb.HandoffChunk() for _ in msgs]
    for a, b in zip(flipped, msgs, strict=True):
        a.CopyFrom(b)
    data = bytearray(flipped[i_data].state.tensor.data)
    data[0] ^= 1
    flipped[i_data].state.tensor.data = bytes(data)
    with pytest.raises(HandoffError, match="checksum mismatch"):
        feed(flipped)
    with pytest.raises(HandoffError, match=r"twice|more bytes"):
        feed([*msgs[: i_data + 1], msgs[i_data], *msgs[i_data + 1 :]])
    dropped = [m for i, m in enumerate(msgs) if i != i_data]
    with pytest.raises(HandoffError, match=r"end marker says .* received"):
        feed(dropped)
    consistent = [*dropped[:-1], pb.HandoffChunk()]  # an end marker that counts what was sent
    consistent[-1].end.CopyFrom(msgs[-1].end)
    consistent[-1].end.num_messages -= 1
    consistent[-1].end.payload_bytes -= len(msgs[i_data].state.tensor.data)
    with pytest.raises(HandoffError, match="incomplete"):
        feed(consistent)
    with pytest.raises(HandoffError, match="expected the header"):
        feed(msgs[1:])
    i_kv = next(i for i, m in enumerate(msgs) if m.HasField("kv") and m.kv.page_index == 1)
    overlapping = pb.HandoffChunk()
    overlapping.CopyFrom(msgs[i_kv])
    overlapping.kv.page_index, overlapping.kv.num_tokens = 0, 2 * ps  # pages 0 and 1, both already here
    with pytest.raises(HandoffError, match=f"kv layer {overlapping.kv.layer} page 0 received twice"):
        feed([*msgs[: i_kv + 1], overlapping])
    with pytest.raises(HandoffError, match="could not be decoded"):
        feed([msgs[0], None])  # what grpc hands on when the deserializer failed
    assert d_engine.pages.num_used == 0


def test_tensor_pieces_roundtrip_bf16():
    t = torch.randn(3, 5, 7).to(torch.bfloat16)
    asm = TensorAssembler("t", torch.bfloat16, (3, 5, 7))
    for piece, data in tensor_pieces(t, 17):
        assert len(data) <= 17
        asm.add(piece, data)
    assert asm.complete and torch.equal(asm.tensor(), t)


@pytest.mark.parametrize("piece_bytes", [7, 48, 100, 1000])
def test_paged_target_places_every_split_into_its_pages(piece_bytes):
    """Pieces cut anywhere (inside a page, across several, a partial last page) land in their scattered
    pages and nowhere else."""
    page_rows, row_bytes, rows = 4, 12, 4 * 5 + 3  # 6 pages, the last one 3 rows of 4
    pool = torch.zeros(16, page_rows * row_bytes, dtype=torch.uint8)
    ids = torch.tensor([9, 2, 14, 3, 0, 7])
    t = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8)
    asm = TensorAssembler("t", torch.uint8, tuple(t.shape), pages=PagedTarget(pool.numpy(), ids.numpy(), t.numel()))
    pieces = list(tensor_pieces(t, piece_bytes))
    for piece, data in reversed(pieces):
        asm.add(piece, data)
    assert asm.complete
    want = torch.zeros_like(pool)
    flat = torch.cat([t.reshape(-1), torch.zeros(len(ids) * pool.shape[1] - t.numel(), dtype=torch.uint8)])
    want[ids] = flat.view(len(ids), -1)
    assert torch.equal(pool, want)
    with pytest.raises(ValueError, match="do not fill"):
        PagedTarget(pool.numpy(), ids.numpy(), 2 * pool.shape[1])


def test_block_hashes_are_equal_across_processes():
    code = (
        "from engine.block_hash import block_hashes, namespace;"
        "print([h.hex() for h in block_hashes(namespace('abc', 'salt'), list(range(100)), 16)])"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]), check=True,
        ).stdout
        for seed in ("1", "2")
    }  # fmt: skip
    assert len(outs) == 1
    hashes = block_hashes(namespace("abc", "salt"), list(range(100)), 16)
    assert str([h.hex() for h in hashes]) == outs.pop().strip() and len(hashes) == 6
    assert block_hashes(namespace("abc", "other"), list(range(100)), 16)[0] != hashes[0]


def test_generated_grpc_code_is_current():
    r = subprocess.run([sys.executable, "-m", "tandem.rpc.codegen", "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
