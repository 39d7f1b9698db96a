"""The parallel layout of one engine: prefill context parallelism (PCP), pipeline stages (PP), tensor
parallelism (TP). Frozen and validated once; every guard names the layout it refuses, so a bad
combination fails at startup and never as a hang or a wrong token at run time.

Rank numbering (one process per rank; rank 0 serves gRPC and drives the others):

    rank = stage * inner + inner_rank        inner = pcp (prefill) or tp (decode); one of them is 1

    pp=2, pcp=2:   stage 0: ranks 0 1   stage 1: ranks 2 3     (the stage boundary pairs 0->2, 1->3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.model_config import ModelConfig

MAX_PP = 8
BACKENDS = ("auto", "gloo", "nccl")


class ParallelLayoutError(ValueError):
    """A parallel layout this engine cannot run; raised at startup, before any rank starts."""


@dataclass(frozen=True)
class ParallelConfig:
    pcp: int = 1
    """Prefill context parallelism: a step's token rows are striped round-robin over pcp ranks."""
    pp: int = 1
    """Pipeline stages; each owns a contiguous range of layers (at most 8)."""
    tp: int = 1
    """Tensor parallelism: attention heads, MLP columns and expert columns sharded over tp ranks."""
    pp_microbatches: int = 0
    """Microbatches a step is cut into so pipeline stages overlap (0: pp of them; 1: no overlap)."""
    backend: str = "auto"
    """torch.distributed backend: 'gloo' (CPU), 'nccl' (CUDA), 'auto' (by device)."""
    tp_shard_lm_head: bool | None = None
    """Shard the LM head over the vocabulary under TP (all-gather of logits) instead of replicating
    it. None: sharded on CUDA, replicated on CPU (docs/PARALLEL.md has the measurements)."""
    startup_timeout_s: float = 180.0

    def __post_init__(self) -> None:
        for name in ("pcp", "pp", "tp"):
            if getattr(self, name) < 1:
                raise ParallelLayoutError(f"{name}={getattr(self, name)} must be >= 1")
        if self.pcp > 1 and self.tp > 1:
            raise ParallelLayoutError(
                f"unsupported parallel layout pcp={self.pcp} x tp={self.tp}: context parallelism is a prefill "
                "layout and tensor parallelism a decode layout; an engine runs one of them (with pp)"
            )
        if self.pp > MAX_PP:
            raise ParallelLayoutError(f"unsupported parallel layout pp={self.pp}: at most {MAX_PP} pipeline stages")
        if self.pp_microbatches < 0:
            raise ParallelLayoutError(f"pp_microbatches={self.pp_microbatches} must be >= 0")
        if self.backend not in BACKENDS:
            raise ParallelLayoutError(f"backend={self.backend!r}; expected one of {BACKENDS}")

    # ---- shape of the world -------------------------------------------------------------------------
    @property
    def inner(self) -> int:
        """Ranks per stage (the PCP or TP group size)."""
        return self.pcp * self.tp

    @property
    def world_size(self) -> int:
        return self.pp * self.inner

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def num_microbatches(self) -> int:
        return self.pp_microbatches or self.pp

    def describe(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in ("pcp", "pp", "tp") if getattr(self, k) > 1]
        return " x ".join(parts) or "single rank"

    def stage_of(self, rank: int) -> int:
        return rank // self.inner

    def inner_rank_of(self, rank: int) -> int:
        return rank % self.inner

    def rank_of(self, stage: int, inner_rank: int) -> int:
        return stage * self.inner + inner_rank

    def stage_layers(self, num_layers: int, stage: int) -> range:
        """Contiguous, balanced layer ranges; earlier stages take the remainder (they also embed)."""
        base, extra = divmod(num_layers, self.pp)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (1 if stage < extra else 0))

    # ---- guards that need the model or the role ------------------------------------------------------
    def check_model(self, cfg: ModelConfig) -> None:
        layout = self.describe()
        if self.pp > cfg.num_hidden_layers:
            raise ParallelLayoutError(
                f"unsupported parallel layout {layout}: {cfg.num_hidden_layers} layers cannot fill {self.pp} stages"
            )
        if self.tp == 1:
            return
        need = {"attention heads": cfg.num_attention_heads, "MLP intermediate size": cfg.intermediate_size}
        if cfg.kda_layers:
            need["KDA heads"] = cfg.kda_num_heads
        if cfg.num_experts:
            need["expert intermediate size"] = cfg.moe_intermediate_size
        for what, n in need.items():
            if n % self.tp:
                raise ParallelLayoutError(
                    f"unsupported parallel layout {layout} for {cfg.architecture}: {n} {what} do not split over "
                    f"tp={self.tp}"
                )
        kv = cfg.num_key_value_heads
        if cfg.family == "qwen3" and kv % self.tp and self.tp % kv:
            raise ParallelLayoutError(
                f"unsupported parallel layout {layout} for {cfg.architecture}: {kv} KV heads neither split over "
                f"nor replicate evenly across tp={self.tp}"
            )

    def check_role(self, role: str) -> None:
        """Prefill runs PCP x PP, decode TP x PP; a worker refuses the other role's layout."""
        if role == "prefill" and self.tp > 1:
            raise ParallelLayoutError(
                f"unsupported prefill layout {self.describe()}: prefill workers run pcp x pp; tp is a decode layout"
            )
        if role == "decode" and self.pcp > 1:
            raise ParallelLayoutError(
                f"unsupported decode layout {self.describe()}: decode workers run tp x pp; pcp is a prefill layout"
            )

    def check_service(self, role: str, enable_prefix_caching: bool) -> None:
        self.check_role(role)
        if not self.enabled:
            return
        if enable_prefix_caching:
            raise ParallelLayoutError(
                f"unsupported {role} layout {self.describe()} with --enable-prefix-caching: the prefix tier files "
                "and loads rank 0's cache tensors only (the engine-level prefix cache works under PP; the tier "
                "does not yet)"
            )
