"""The handoff that bench.handoff sends: one long prompt's cache, cut into messages by the real producer.

Cache shapes are Kimi-Linear-48B-A3B's: 27 layers, MLA on every 4th and the last (7 layers; a token's entry is
kv_lora_rank 512 + rope 64 bf16 values, 16-token pages), KDA on the other 20 (32 heads x 128 x 128 fp32
recurrent state, conv state of kernel 4). The producer is fed 1024-token prefill chunks, as the engine schedules
them (EngineConfig.max_num_batched_tokens), so each message is what a prefill worker sends for the given
max_message_bytes.
"""

from __future__ import annotations

import torch

from bench.mid.checkpoint import KIMI_LINEAR_SHAPES
from engine.cache.tensors import CacheLayout, CacheTensors
from engine.fingerprint import Fingerprint
from engine.forward_batch import ForwardBatch
from engine.kv_transfer.consumer import HandoffConsumer, fingerprint_to_pb
from engine.kv_transfer.producer import HandoffProducer
from engine.kv_transfer.wire import EncodedChunk, StreamCount
from engine.model_config import ModelConfig
from tandem.rpc import prefill_pb2 as pb

PAGE_SIZE = 16
PREFILL_CHUNK = 1024
NUM_LAYERS = 27
MLA_LAYERS = (3, 7, 11, 15, 19, 23, 26)  # 0-based
FINGERPRINT = Fingerprint("bench-model", "bench-tokenizer", "bfloat16", PAGE_SIZE, "bench-layout")


def bench_config() -> ModelConfig:
    kinds = tuple("mla" if i in MLA_LAYERS else "kda" for i in range(NUM_LAYERS))
    return ModelConfig(
        family="kimi_linear",
        architecture="KimiLinearForCausalLM",
        **KIMI_LINEAR_SHAPES,
        num_hidden_layers=NUM_LAYERS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=1 << 20,
        layer_kinds=kinds,
        mlp_kinds=("moe",) * NUM_LAYERS,
        bos_token_id=None,
        eos_token_ids=(),
        pad_token_id=None,
        torch_dtype="bfloat16",
        kda_num_heads=32,
        kda_head_dim=128,
        conv_kernel_size=4,
    )


def payload_bytes(cfg: ModelConfig, num_tokens: int) -> int:
    kv = len(cfg.attention_layers) * num_tokens * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    h, k = cfg.kda_num_heads, cfg.kda_head_dim
    state = len(cfg.kda_layers) * (h * k * k * 4 + 3 * h * k * (cfg.conv_kernel_size - 1) * 2)
    return kv + state


def tokens_for(cfg: ModelConfig, total_bytes: int) -> int:
    """The prompt length (whole prefill chunks) whose handoff is closest to total_bytes, at least one chunk."""
    per_chunk = payload_bytes(cfg, PREFILL_CHUNK) - payload_bytes(cfg, 0)
    return PREFILL_CHUNK * max(1, round((total_bytes - payload_bytes(cfg, 0)) / per_chunk))


def make_cache(cfg: ModelConfig, num_pages: int, seed: int | None) -> CacheTensors:
    """A CPU cache with one state slot; random contents when seed is given (the sender's), else zeros."""
    cache = CacheTensors(cfg, CacheLayout(PAGE_SIZE, num_pages, 1), torch.bfloat16, torch.device("cpu"))
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for pool in (*cache.kv.values(), *cache.recurrent.values(), *cache.conv.values()):
            raw = pool.view(-1).view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    return cache


def produce(
    cfg: ModelConfig, cache: CacheTensors, num_tokens: int, max_bytes: int
) -> list[pb.HandoffChunk | EncodedChunk]:
    """The whole stream the prefill service sends for one request: header, the producer's kv / state
    messages as the prefill chunks finish layer by layer, block hashes, first token, end marker."""
    pages = -(-num_tokens // PAGE_SIZE)
    header = pb.HandoffHeader(
        producer_fingerprint=fingerprint_to_pb(FINGERPRINT),
        num_prompt_tokens=num_tokens,
        page_size=PAGE_SIZE,
        attention_layers=list(cfg.attention_layers),
        kda_layers=list(cfg.kda_layers),
    )
    msgs: list = [pb.HandoffChunk(header=header)]
    producer = HandoffProducer(cfg, cache, PAGE_SIZE)
    producer.register("r", msgs.append, max_bytes)
    empty = torch.zeros(0, dtype=torch.long)
    for start in range(0, num_tokens, PREFILL_CHUNK):
        end = min(start + PREFILL_CHUNK, num_tokens)
        batch = ForwardBatch(
            input_ids=empty,
            positions=empty,
            query_start_loc=[0, end - start],
            context_lens=[end],
            block_tables=[torch.arange(pages)],
            slot_mapping=empty,
            state_slots=[0],
            has_initial_state=[start > 0],
            logits_indices=empty,
            request_ids=["r"],
            chunk_starts=[start],
            completes_prompt=[end == num_tokens],
        )
        for layer in range(cfg.num_hidden_layers):
            producer.on_layer(layer, batch)
    msgs.append(pb.HandoffChunk(block_hashes=pb.BlockHashes(hashes=[bytes(32)] * (num_tokens // PAGE_SIZE))))
    first = pb.FirstToken()
    first.token.token_id = 1
    msgs.append(pb.HandoffChunk(first_token=first))
    msgs.append(_end_marker(msgs))
    return msgs


def _end_marker(stream: list) -> pb.HandoffChunk:
    """The end marker that counts ``stream`` (the messages before it)."""
    count = StreamCount()
    for m in stream:
        count.sent(m)
    return count.end()


def deal(msgs: list[pb.HandoffChunk | EncodedChunk], lanes: int) -> list[list[pb.HandoffChunk | EncodedChunk]]:
    """[Prefill stream, lane 1, ...]: ``produce``'s stream dealt as the prefill service deals it over lanes
    (engine/kv_transfer/lanes.py: kv / state message k to lane k % lanes, each lane with its own end)."""
    if lanes <= 1:
        return [msgs]
    header = pb.HandoffChunk()
    header.CopyFrom(msgs[0])
    header.header.lanes = lanes
    streams: list[list] = [[header]] + [[] for _ in range(lanes - 1)]
    data = [m for m in msgs[1:-1] if isinstance(m, EncodedChunk)]
    for k, m in enumerate(data):
        streams[k % lanes].append(m)
    streams[0] += [m for m in msgs[1:-1] if not isinstance(m, EncodedChunk)]
    return [stream + [_end_marker(stream)] for stream in streams]


def wire_bytes(msg: pb.HandoffChunk | EncodedChunk) -> bytes:
    """What the prefill stream sends for msg."""
    return msg.wire if isinstance(msg, EncodedChunk) else msg.SerializeToString()


def consumer_for(
    cfg: ModelConfig, cache: CacheTensors, num_tokens: int, page_ids: list[int], lanes: int = 1
) -> HandoffConsumer:
    return HandoffConsumer(cfg, cache, FINGERPRINT, num_tokens, page_ids, [0], max_lanes=lanes)


def same_contents(a: CacheTensors, b: CacheTensors, num_tokens: int, page_ids_b: list[int]) -> bool:
    """b (the receiver's, at page_ids_b) holds what a (the sender's, pages 0..) holds for the prompt."""
    pages = -(-num_tokens // PAGE_SIZE)
    for layer, kv in a.kv.items():
        got = b.kv[layer][page_ids_b[:pages]].flatten(0, 1)[:num_tokens]
        if not torch.equal(got.view(torch.uint8), kv[:pages].flatten(0, 1)[:num_tokens].view(torch.uint8)):
            return False
    states = [(b.recurrent[i][0], a.recurrent[i][0]) for i in a.recurrent]
    states += [(b.conv[i][0], a.conv[i][0]) for i in a.conv]
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in states)  # random bits: NaNs
