"""Engine configuration: frozen, validated once, copied with ``dataclasses.replace`` per process."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.parallel.config import ParallelConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")


SPECULATIVE_METHODS = ("ngram", "aux_tap")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding of a decode worker. A prefill worker refuses any of it."""

    method: str | None = None
    """'ngram' | 'aux_tap'; None: no speculation."""
    num_speculative_tokens: int = 0
    draft_model: str | None = None
    """Drafter checkpoint directory (aux_tap)."""
    ngram_min: int = 1
    ngram_max: int = 4
    """n-gram drafter: the longest suffix (ngram_max .. ngram_min tokens) seen earlier is matched."""

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {self.method!r}; expected one of {SPECULATIVE_METHODS}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.method == "aux_tap" and not self.draft_model:
            raise ValueError("speculative method 'aux_tap' needs draft_model (a drafter checkpoint directory)")
        if (self.method is None) != (self.num_speculative_tokens == 0) and self.draft_model is None:
            raise ValueError(
                f"speculative method={self.method!r} with num_speculative_tokens={self.num_speculative_tokens}: "
                "set both, or neither"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}: need 1 <= min <= max")

    @property
    def enabled(self) -> bool:
        return self.method is not None or self.num_speculative_tokens > 0 or self.draft_model is not None


GPU_PAGE_SIZE = 64
CPU_PAGE_SIZE = 16


def default_page_size(device: str) -> int:
    """EngineConfig's page size when none is given: GPU_PAGE_SIZE where ``device`` resolves to CUDA."""
    if device == "auto":
        import torch

        return GPU_PAGE_SIZE if torch.cuda.is_available() else CPU_PAGE_SIZE
    return GPU_PAGE_SIZE if device.startswith("cuda") else CPU_PAGE_SIZE


@dataclass(frozen=True)
class EngineConfig:
    model: str
    """HF checkpoint directory (config.json, *.safetensors, tokenizer.json)."""
    dtype: str = "auto"
    """Weight/activation dtype; 'auto' takes the checkpoint's dtype. KDA state is always fp32."""
    device: str = "auto"
    """'cpu', 'cuda' or 'auto' (cuda when available)."""
    page_size: int | None = None
    """Tokens per KV page. None: 64 on CUDA — the page FlashMLA's MLA decode reads (decode at batch 64 went from
    70 / 62 % to 73 / 78 % of the copy roofline at 4k / 32k with it, docs/PERFORMANCE.md) and the size vLLM
    takes for it — and 16 elsewhere (the CPU reference path). Prefill and decode workers must agree: the
    handoff fingerprint includes it (``default_page_size``)."""
    max_num_seqs: int = 32
    """Most requests running at once."""
    max_num_batched_tokens: int = 1024
    """Token budget of one step; a longer prompt is prefilled in chunks of at most this many tokens."""
    max_model_len: int | None = None
    """Longest prompt + output; default: the model's max_position_embeddings, capped by the KV pool."""
    kv_cache_memory_bytes: int | None = None
    """Byte budget for KV pages + KDA state slots (CPU default: 256 MiB)."""
    gpu_memory_utilization: float = 0.9
    """On CUDA: fraction of device memory the engine may use in total (weights included)."""
    seed: int = 0
    """Seed of requests that sample without their own seed."""
    load_progress: bool = False
    """Show a progress bar while loading weights."""
    enable_prefix_caching: bool = False
    """Keep full pages (and KDA checkpoints at rungs) by block hash and reuse them across requests."""
    kda_checkpoint_pages: int = 4
    """Rung interval in pages: KDA state is checkpointed every this many pages (x page_size must be
    a multiple of the KDA chunk, 64)."""
    num_checkpoint_slots: int | None = None
    """KDA state slots kept for checkpoints (default: 2 x max_num_seqs when prefix caching)."""
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    """Speculative decoding (decode workers only); requests may lower k or turn it off."""
    cpu_threads: int = 1
    """torch intra-op threads on CPU. 1 by default: the tiny models' ops are microseconds long and
    extra threads spin against the other processes of a local cluster (measured ~70x slower)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """PCP / PP / TP layout; one process per rank, started by the engine (docs/PARALLEL.md)."""
    cuda_graphs: bool = False
    """Run pure-decode steps on static padded buffers, captured as CUDA graphs per batch size, and the other
    steps as piecewise graphs per token bucket (prefill_graph_max_tokens) — vLLM's default; off here until
    validated on the GPU. On the host the same padded paths run eagerly. One page and one KDA slot are
    reserved as the padding rows' scratch. Single-process engines only."""
    async_scheduling: bool = False
    """Overlap a pure-decode step's host work with the previous step's GPU work (vLLM's async scheduling):
    the next step is launched with the previous step's ids still on the device (engine/overlap.py). Needs
    cuda_graphs (the static-buffer step); steps with sampled rows, logprobs, arrivals or rung checkpoints
    run in sequence as before."""
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    """Padded batch sizes with a graph (default: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs); larger
    decode batches run eagerly."""
    capture_graphs_at_start: bool = True
    """With cuda_graphs: workers (prefill / decode services) capture the piecewise prefill graphs of every
    token bucket before they report ready (``LLMEngine.capture_graphs``), so no request waits for a capture;
    False: each bucket is captured on its first step (as the offline engine always does)."""
    prefill_graph_max_tokens: int = 8192
    """With cuda_graphs: steps the decode graphs do not take (prefill, mixed, verify) of up to this many tokens
    (capped by max_num_batched_tokens) run as piecewise CUDA graphs over token buckets, with attention and the
    KDA conv / recurrence eager between the pieces (engine/prefill_graph). 0: those steps run eagerly."""
    prefill_layout_graphs: int = 8
    """With the piecewise prefill graphs: the first this many KDA layouts seen (chunk lengths, which chunks
    continue a state) are tracked, and those seen again get pieces with their KDA conv / recurrence inside the
    graphs (every full chunk of a long prompt after the first shares one; engine/prefill_graph/layouts.py).
    0: the KDA cores stay eager."""

    def __post_init__(self) -> None:
        if self.page_size is None:  # resolved once: every copy (dataclasses.replace, rank processes) keeps it
            object.__setattr__(self, "page_size", default_page_size(self.device))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; expected one of {DTYPES}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device!r}; expected 'auto', 'cpu' or 'cuda[:N]'")
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "cpu_threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len={self.max_model_len} must be > 0")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be > 0")
        if self.cuda_graph_batch_sizes is not None and (
            not self.cuda_graph_batch_sizes or min(self.cuda_graph_batch_sizes) < 1
        ):
            raise ValueError(f"cuda_graph_batch_sizes={self.cuda_graph_batch_sizes} must be positive sizes")
        for name in ("prefill_graph_max_tokens", "prefill_layout_graphs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.cuda_graphs and self.parallel.enabled:
            from engine.parallel.config import ParallelLayoutError

            raise ParallelLayoutError(
                f"unsupported parallel layout {self.parallel.describe()} with --cuda-graphs: "
                "decode graphs are single-rank only"
            )
        if self.async_scheduling and not self.cuda_graphs:
            raise ValueError(
                "async_scheduling needs cuda_graphs (the overlapped step is the static-buffer decode step)"
            )
        if self.async_scheduling and self.speculative.enabled:
            raise ValueError("async_scheduling with speculative decoding is not supported: verify steps need the host")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
