"""Tensor parallelism: which parameters are sharded, how, and where the partial sums meet.

Megatron layout, expressed on the unchanged model classes (parameter names stay the checkpoint's):

    column (dim 0, by head / column)     q|k|v projections, KDA conv / gate / beta params, kv_b_proj,
                                         gate_proj|up_proj, experts.w1|w3 (dim 1 of [E, I, H])
    row (last dim)                       o_proj, down_proj, experts.w2 (dim 2 of [E, H, I])
    replicated                           norms, MLA kv_a_proj (the latent is replicated), routers,
                                         KDA f_a / g_a (head_dim wide), embedding, LM head (or vocab-sharded)

A block's row-parallel outputs are partial sums: one all-reduce per attention block and one per MLP /
MoE block (routed experts and the shared expert are summed first), via forward hooks on those
modules. GQA KV heads are split when tp divides them and replicated when they divide tp.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.parallel.groups import ParallelGroups

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_COLUMN = re.compile(
    r"^(self_attn\.(q_proj|k_proj|v_proj|kv_b_proj|f_b_proj|g_b_proj|b_proj)\.weight"
    r"|self_attn\.(q_conv1d|k_conv1d|v_conv1d)\.weight|self_attn\.dt_bias"
    r"|(mlp|block_sparse_moe\.shared_experts)\.(gate_proj|up_proj)\.weight)$"
)
_ROW = re.compile(r"^(self_attn\.o_proj|mlp\.down_proj|block_sparse_moe\.shared_experts\.down_proj)\.weight$")
_EXPERT_DIM = {"block_sparse_moe.experts.w1": 1, "block_sparse_moe.experts.w3": 1, "block_sparse_moe.experts.w2": 2}


@dataclass(frozen=True)
class TPShard:
    """This rank's slice of a parameter: [start, start + size) along dim."""

    dim: int
    start: int
    size: int

    def take(self, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(self.dim, self.start, self.size)


class TPPlan:
    def __init__(self, cfg: ModelConfig, tp: int, rank: int, shard_lm_head: bool) -> None:
        self.cfg, self.tp, self.rank = cfg, tp, rank
        # a tied head shares the (replicated) embedding's tensor; without TP there is nothing to shard (the
        # stage's inner group may still have ranks: PCP's, whose logits must not be gathered as vocab shards)
        self.shard_lm_head = tp > 1 and shard_lm_head and cfg.vocab_size % tp == 0 and not cfg.tie_word_embeddings
        nkv = cfg.num_key_value_heads
        self.kv_heads = max(nkv // tp, 1)
        self.kv_start = rank * nkv // tp  # replicated KV heads: ranks of one GQA group share the head
        self.kda_heads = cfg.kda_num_heads // tp if cfg.kda_num_heads else 0

    def _even(self, dim: int, n: int) -> TPShard:
        return TPShard(dim, self.rank * (n // self.tp), n // self.tp)

    def shard_of(self, name: str, shape: tuple[int, ...]) -> TPShard | None:
        """The slice of model parameter `name` (shape: the full parameter's) this rank holds."""
        if self.tp == 1:
            return None
        if name == "lm_head.weight":
            return self._even(0, shape[0]) if self.shard_lm_head else None
        m = _LAYER.match(name)
        if m is None:
            return None
        layer, rest = int(m.group(1)), m.group(2)
        if rest in _EXPERT_DIM:
            dim = _EXPERT_DIM[rest]
            return self._even(dim, shape[dim])
        if self.cfg.layer_kinds[layer] == "gqa" and rest in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
            unit = self.cfg.head_dim
            return TPShard(0, self.kv_start * unit, self.kv_heads * unit)
        if rest == "self_attn.A_log":  # [1, 1, heads, 1]
            return self._even(2, shape[2])
        if _COLUMN.match(rest):
            return self._even(0, shape[0])
        if _ROW.match(rest):
            return self._even(len(shape) - 1, shape[-1])
        return None

    # ---- building the sharded model ----------------------------------------------------------------
    def shard_parameters(self, model: nn.Module) -> None:
        """Replace each sharded parameter by an empty one of the local shape (model still on meta)."""
        for name, p in list(model.named_parameters()):
            s = self.shard_of(name, tuple(p.shape))
            if s is None:
                continue
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            shape = list(p.shape)
            shape[s.dim] = s.size
            setattr(owner, attr, nn.Parameter(torch.empty(shape, dtype=p.dtype, device=p.device), requires_grad=False))
        for layer in model.model.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is None:
                continue
            attn.num_heads //= self.tp  # every attention kind reshapes by its local head count
            if hasattr(attn, "num_kv_heads"):
                attn.num_kv_heads = self.kv_heads

    def install_reductions(self, model: nn.Module, groups: ParallelGroups) -> None:
        """All-reduce the partial sums of each attention and MLP / MoE block (nothing at tp=1: the
        stage's inner group is then the PCP group, whose ranks hold different rows)."""
        if self.tp == 1:
            return

        def reduce(_m: nn.Module, _inp: object, out: torch.Tensor) -> torch.Tensor:
            return groups.all_reduce(out)

        model.fuse_next_norm = False  # a block's output is a partial sum until the hook below: no norm inside it
        for layer in model.model.layers:
            for name in ("self_attn", "mlp", "block_sparse_moe"):
                block = getattr(layer, name, None)
                if block is not None:
                    block.register_forward_hook(reduce)

    def local_model_config(self) -> ModelConfig:
        """The per-rank head counts the cache tensors are sized by."""
        import dataclasses

        return dataclasses.replace(self.cfg, num_key_value_heads=self.kv_heads, kda_num_heads=self.kda_heads)

    # ---- canonical (full heads) -> local, for P/D imports ------------------------------------------
    def local_kv(self, entries: torch.Tensor) -> torch.Tensor:
        """[n, *kv_entry] canonical -> this rank's heads (MLA's latent is replicated)."""
        if self.tp == 1 or self.cfg.family != "qwen3":
            return entries
        return entries[:, :, self.kv_start : self.kv_start + self.kv_heads]

    def local_recurrent(self, state: torch.Tensor) -> torch.Tensor:
        """[heads, K, V] -> [local heads, K, V]."""
        if self.tp == 1:
            return state
        return state[self.rank * self.kda_heads : (self.rank + 1) * self.kda_heads]

    def local_conv(self, window: torch.Tensor) -> torch.Tensor:
        """[3 * heads * K, W-1] (q|k|v) -> [3 * local heads * K, W-1]."""
        if self.tp == 1:
            return window
        h, k = self.cfg.kda_num_heads, self.cfg.kda_head_dim
        lo = self.rank * self.kda_heads
        return window.view(3, h, k, -1)[:, lo : lo + self.kda_heads].reshape(3 * self.kda_heads * k, -1)
