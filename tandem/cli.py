"""The `tandem` command: make-tiny-model, generate, bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

DEFAULT_MODEL_DIR = Path(os.environ.get("TANDEM_MODEL_DIR", ".models/tiny-kimi-linear"))


def default_model() -> Path:
    """The bundled tiny model: generated on first use, never committed."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        from engine.tiny_model import make_tiny_model

        make_tiny_model(DEFAULT_MODEL_DIR, arch="kimi_linear", seed=0)
        print(f"generated the bundled tiny model in {DEFAULT_MODEL_DIR}", file=sys.stderr)
    return DEFAULT_MODEL_DIR


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None, help="HF checkpoint dir (default: bundled tiny model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--cpu-threads", type=int, default=1)


def engine_config_from_args(a: argparse.Namespace):
    from engine.config import EngineConfig

    return EngineConfig(
        model=str(a.model or default_model()),
        dtype=a.dtype,
        device=a.device,
        page_size=a.page_size,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len,
        kv_cache_memory_bytes=a.kv_cache_memory_bytes,
        gpu_memory_utilization=a.gpu_memory_utilization,
        cpu_threads=a.cpu_threads,
        load_progress=True,
    )


def cmd_make_tiny_model(a: argparse.Namespace) -> int:
    from engine.tiny_model import make_tiny_model

    out = make_tiny_model(a.out, arch=a.arch, seed=a.seed, dtype=a.dtype, num_shards=a.num_shards)
    print(out)
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(engine_config_from_args(a))
    params = SamplingParams(
        max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed
    )
    prompts = a.prompt or ["Hello"]
    if a.chat:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    for prompt, out in zip(prompts, engine.generate(prompts, params, use_tqdm=True), strict=True):
        text = engine.tokenizer.decode(out.output_token_ids)
        print(f"--- prompt: {prompt!r}\n{text}\n[{len(out.output_token_ids)} tokens, {out.finish_reason}]")
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from bench.offline import run_offline_bench

    run_offline_bench(engine_config_from_args(a), a.batch, a.prompt_len, a.output_len)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="write a deterministic tiny HF checkpoint")
    p.add_argument("--arch", default="kimi_linear", choices=["kimi_linear", "qwen3"])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-shards", type=int, default=1)
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("generate", help="offline generation")
    _add_engine_args(p)
    p.add_argument("--prompt", action="append", help="repeat for several prompts")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True)
    b = bsub.add_parser("offline", help="offline prefill and decode throughput")
    _add_engine_args(b)
    b.add_argument("--batch", type=int, default=16)
    b.add_argument("--prompt-len", type=int, default=256)
    b.add_argument("--output-len", type=int, default=64)
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
