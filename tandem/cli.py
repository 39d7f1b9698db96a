"""The `tandem` command: make-tiny-model, generate, bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
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
    p.add_argument(
        "--page-size",
        type=int,
        default=None,
        help="tokens per KV page (default: 64 on CUDA, FlashMLA's page; 16 on CPU); prefill and decode must agree",
    )
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--enable-prefix-caching", action="store_true", help="reuse prefixes (device cache + tier)")
    p.add_argument("--kda-checkpoint-pages", type=int, default=4, help="KDA checkpoint rung interval in pages")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="capture pure-decode steps as CUDA graphs per padded batch size, and other steps as piecewise graphs "
        "per token bucket (single-rank engines; off by default until validated: docs/PERFORMANCE.md)",
    )
    p.add_argument(
        "--prefill-graph-max-tokens",
        type=int,
        default=8192,
        help="with --cuda-graphs: largest token bucket of the piecewise prefill graphs (0: prefill runs eagerly)",
    )
    p.add_argument(
        "--prefill-layout-graphs",
        type=int,
        default=8,
        help="with --cuda-graphs: KDA layouts (chunk lengths) seen twice whose KDA conv / recurrence run inside the "
        "prefill graphs, at most this many (0: the KDA cores stay eager between the pieces)",
    )
    p.add_argument(
        "--lazy-graphs",
        action="store_true",
        help="with --cuda-graphs: a worker captures each prefill token bucket on its first step instead of all "
        "of them before it reports ready",
    )
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="with --cuda-graphs: launch each pure-decode step before the previous step's ids reach the host, "
        "overlapping host work with GPU work (greedy rows; others run in sequence)",
    )
    p.add_argument("--pcp", type=int, default=1, help="prefill context-parallel ranks (prefill workers)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages, at most 8")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (decode workers)")
    p.add_argument("--pp-microbatches", type=int, default=0, help="microbatches per step under pp (0: pp)")


def engine_config_from_args(a: argparse.Namespace):
    from engine.config import EngineConfig
    from engine.parallel.config import ParallelConfig

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
        enable_prefix_caching=a.enable_prefix_caching,
        kda_checkpoint_pages=a.kda_checkpoint_pages,
        cuda_graphs=a.cuda_graphs,
        prefill_graph_max_tokens=a.prefill_graph_max_tokens,
        prefill_layout_graphs=a.prefill_layout_graphs,
        capture_graphs_at_start=not a.lazy_graphs,
        async_scheduling=a.async_scheduling,
        load_progress=True,
        parallel=ParallelConfig(pcp=a.pcp, pp=a.pp, tp=a.tp, pp_microbatches=a.pp_microbatches),
    )


def cmd_make_tiny_model(a: argparse.Namespace) -> int:
    from engine.tiny_model import make_tiny_model

    if a.arch == "aux_tap_drafter":
        from engine.spec.aux_tap import make_tiny_drafter

        if a.target is None:
            raise ValueError("--arch aux_tap_drafter needs --target (the target model's checkpoint dir)")
        taps = tuple(int(t) for t in a.aux_layer_ids.split(","))
        print(make_tiny_drafter(a.out, a.target, taps, seed=a.seed))
        return 0
    out = make_tiny_model(a.out, arch=a.arch, seed=a.seed, dtype=a.dtype, num_shards=a.num_shards)
    print(out)
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    from engine.parallel import create_engine
    from engine.sampling_params import SamplingParams

    engine = create_engine(engine_config_from_args(a))
    params = SamplingParams(
        max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed
    )
    prompts = a.prompt or ["Hello"]
    if a.chat:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    for prompt, out in zip(prompts, engine.generate(prompts, params, use_tqdm=True), strict=True):
        text = engine.tokenizer.decode(out.output_token_ids)
        print(f"--- prompt: {prompt!r}\n{text}\n[{len(out.output_token_ids)} tokens, {out.finish_reason}]")
    engine.close()
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from bench.offline import run_offline_bench

    run_offline_bench(engine_config_from_args(a), a.batch, a.prompt_len, a.output_len)
    return 0


def _speculative(a: argparse.Namespace):
    from engine.config import SpeculativeConfig

    return SpeculativeConfig(a.speculative_method, a.num_speculative_tokens, a.draft_model)


def _data_port(value: str) -> int | None:
    if value == "off":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither a port number nor 'off'") from None


def _add_worker_args(p: argparse.ArgumentParser, port: int) -> None:
    _add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--drain-seconds", type=float, default=10.0)
    p.add_argument("--speculative-method", default=None, help="decode workers only: ngram | aux_tap")
    p.add_argument("--num-speculative-tokens", type=int, default=0, help="decode workers only")
    p.add_argument("--draft-model", default=None, help="decode workers only")
    p.add_argument("--redis-url", default=None, help="shared prefix index + remote tier (default: in-process)")
    p.add_argument("--tier-cpu-bytes", type=int, default=256 << 20)
    p.add_argument("--tier-disk-dir", default=None)
    p.add_argument("--tier-disk-bytes", type=int, default=0)
    p.add_argument("--tier-capacity-bytes", type=int, default=None)
    p.add_argument("--instance-id", default=None, help="name in the prefix index (default: host:port)")
    p.add_argument(
        "--handoff-lanes",
        type=int,
        default=None,
        help="decode: streams to pull each handoff over (default 1); prefill: the most it grants (default 8)",
    )
    p.add_argument(
        "--handoff-transport",
        choices=("grpc", "socket"),
        default="socket",
        help="decode: pull the handoff's kv / state bytes over the prefill worker's socket data plane (default; "
        "gRPC lanes when that worker runs none) or over gRPC lanes",
    )
    p.add_argument(
        "--advertise-host",
        default=None,
        help="prefill: the address other hosts dial for stage streams / socket lanes (default: --host, or the "
        "hostname for 0.0.0.0)",
    )
    p.add_argument(
        "--handoff-data-port",
        type=_data_port,
        default=0,
        help="prefill: serve socket lanes on this port (default 0: any free one, advertised in each handoff's "
        "header; off: gRPC lanes only)",
    )


def _prefix_store(a: argparse.Namespace):
    from kvstore.store import PrefixStoreConfig
    from kvstore.tier import TierConfig

    tier = TierConfig(
        local_cpu_bytes=a.tier_cpu_bytes,
        local_disk_dir=a.tier_disk_dir,
        local_disk_bytes=a.tier_disk_bytes,
        capacity_bytes=a.tier_capacity_bytes,
    )
    return PrefixStoreConfig(redis_url=a.redis_url, tier=tier, instance_id=a.instance_id)


def prefill_config_from_args(a: argparse.Namespace):
    """The prefill worker's config; its checks (a producer never speculates, supported layouts) run here,
    before anything is loaded. deploy/'s manifest test builds its pods' configs with this too."""
    from prefill_svc.config import PrefillConfig

    return PrefillConfig(
        engine_config_from_args(a),
        a.host,
        a.port,
        a.metrics_port,
        _speculative(a),
        a.drain_seconds,
        _prefix_store(a),
        max_handoff_lanes=a.handoff_lanes or PrefillConfig.max_handoff_lanes,
        data_port=a.handoff_data_port,
        advertise_host=a.advertise_host,
    )


def decode_config_from_args(a: argparse.Namespace):
    """The decode worker's config, checked the same way (see ``prefill_config_from_args``)."""
    import dataclasses

    from decode_svc.config import DecodeConfig

    spec = _speculative(a)
    return DecodeConfig(
        dataclasses.replace(engine_config_from_args(a), speculative=spec),
        a.host,
        a.port,
        a.metrics_port,
        spec,
        a.drain_seconds,
        _prefix_store(a),
        handoff_lanes=a.handoff_lanes or DecodeConfig.handoff_lanes,
        handoff_transport=a.handoff_transport,
    )


def cmd_prefill(a: argparse.Namespace) -> int:
    from prefill_svc.main import run

    run(prefill_config_from_args(a))
    return 0


def cmd_decode(a: argparse.Namespace) -> int:
    from decode_svc.main import run

    run(decode_config_from_args(a))
    return 0


def router_config_from_args(a: argparse.Namespace):
    from router.main import RouterConfig

    return RouterConfig(
        model=str(a.model or default_model()),
        prefill=tuple(a.prefill or ()),
        decode=tuple(a.decode or ()),
        host=a.host,
        http_port=a.http_port,
        grpc_port=a.grpc_port,
        served_model_name=a.served_model_name,
        redis_url=a.redis_url,
        worker_wait_s=a.worker_wait_seconds,
    )


def cmd_router(a: argparse.Namespace) -> int:
    from router.main import run

    run(router_config_from_args(a))
    return 0


def worker_args(a: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(prefill flags, decode flags) of `tandem serve`: each option takes the rest of the command line, so the
    one given first also swallows the other; split them again."""
    pre, dec = list(a.prefill_args or []), list(a.decode_args or [])
    if "--decode-args" in pre:
        i = pre.index("--decode-args")
        pre, dec = pre[:i], pre[i + 1 :] + dec
    if "--prefill-args" in dec:
        i = dec.index("--prefill-args")
        dec, pre = dec[:i], dec[i + 1 :] + pre
    return pre, dec


def cmd_serve(a: argparse.Namespace) -> int:
    import signal as _signal

    from tandem.cluster import LocalCluster, WorkerSpec

    model = a.model or default_model()
    common = [] if a.no_prefix_caching else ["--enable-prefix-caching"]
    if a.redis_url:
        common += ["--redis-url", a.redis_url]
    prefill_args, decode_args = worker_args(a)
    cluster = LocalCluster(
        model,
        [WorkerSpec("prefill", common + prefill_args), WorkerSpec("decode", common + decode_args)],
        router_args=["--redis-url", a.redis_url] if a.redis_url else [],
        http_port=a.http_port,
        grpc_port=a.grpc_port,
    )
    cluster.start()
    print(f"Tandem is serving {model} at {cluster.base_url} (OpenAI API), gRPC 127.0.0.1:{cluster.grpc_port}")
    print(
        "  try: curl " + cluster.base_url + "/completions -H 'Content-Type: application/json' "
        '-d \'{"model": "' + Path(model).resolve().name + '", "prompt": "Hello", "max_tokens": 16}\''
    )
    print("Ctrl-C stops the router and both workers.", flush=True)
    stop = [False]
    _signal.signal(_signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    try:
        while not stop[0] and all(p.popen.poll() is None for p in cluster.procs):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="write a deterministic tiny HF checkpoint")
    p.add_argument("--arch", default="kimi_linear", choices=["kimi_linear", "qwen3", "aux_tap_drafter"])
    p.add_argument("--target", type=Path, default=None, help="aux_tap_drafter: the target checkpoint dir")
    p.add_argument("--aux-layer-ids", default="-1,1,2", help="aux_tap_drafter: tapped target layers")
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
    p = sub.add_parser("prefill", help="run a prefill worker (never speculates)")
    _add_worker_args(p, 50061)
    p.set_defaults(func=cmd_prefill)

    p = sub.add_parser("decode", help="run a decode worker")
    _add_worker_args(p, 50062)
    p.set_defaults(func=cmd_decode)

    p = sub.add_parser("router", help="run the gateway over registered workers")
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir for the tokenizer and chat template")
    p.add_argument("--prefill", action="append", help="prefill worker host:port (repeat for several)")
    p.add_argument("--decode", action="append", help="decode worker host:port (repeat for several)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50060)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--redis-url", default=None, help="the workers' prefix index: enables prefix-aware routing")
    p.add_argument(
        "--worker-wait-seconds",
        type=float,
        default=120.0,
        help="how long to wait for each worker to answer at startup (GPU workers load and compile for minutes)",
    )
    p.set_defaults(func=cmd_router)

    p = sub.add_parser("serve", help="router + one prefill + one decode worker on localhost")
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50060)
    p.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache and tier off")
    p.add_argument("--redis-url", default=None, help="shared prefix index + remote tier (default: in-process)")
    p.add_argument("--prefill-args", nargs=argparse.REMAINDER, help="extra flags for the prefill worker")
    p.add_argument("--decode-args", nargs=argparse.REMAINDER, help="extra flags for the decode worker")
    p.set_defaults(func=cmd_serve)
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
