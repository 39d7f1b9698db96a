"""Small layers shared by the model families (numerics follow the HF reference implementations)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.backends.base import AddNorm
from engine.backends.fallback import fall_back
from engine.backends.norm import TorchNormBackend
from kernels.activation import silu_mul

if TYPE_CHECKING:
    from engine.backends import Backends
    from engine.cache.tensors import CacheTensors
    from engine.forward_batch import ForwardBatch


class RMSNorm(nn.Module):
    """Holds the weight; the math is the norm backend's (engine/backends/norm.py), the reference without one."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, be: Backends | None = None) -> torch.Tensor:
        return _norms(be).rms_norm(x, self.weight, self.eps)

    def add(
        self, x: torch.Tensor, residual: torch.Tensor, be: Backends | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add fused into the norm where the backend can."""
        return _norms(be).add_rms_norm(x, residual, self.weight, self.eps)


class LayerCarry(NamedTuple):
    """What a decoder layer hands on: its last block's output ``h`` and the residual sum before it (the layer's
    output is their sum), or, ``normed``, the next norm already run by the layer's last launch: ``h`` is that
    norm's output and ``residual`` the layer's output."""

    h: torch.Tensor
    residual: torch.Tensor | None
    normed: bool = False


class PreNormDecoderLayer(nn.Module):
    """HF's pre-norm decoder layer — ``h + attn(norm(h))``, then ``+ mlp(norm(.))`` — with the residual sum
    carried to the next layer instead of added here (vLLM's ``(hidden, residual)`` form): every residual add
    happens inside the norm after it (``RMSNorm.add``), so on CUDA a layer launches no add of its own.

    Subclasses set ``self_attn``, ``input_layernorm``, ``post_attention_layernorm`` and ``feed_forward``."""

    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def feed_forward(self, x: torch.Tensor, be: Backends) -> torch.Tensor:
        raise NotImplementedError

    def attention_input_weight(self, rows: int) -> torch.Tensor | None:
        """The weight of the attention's first projection at a step of ``rows`` rows when the attention can take its
        input already through it (``self_attn(..., projected=True)``), so the dense backend may run the input norm
        inside that projection (``add_norm_linear``); None: it takes the normed input."""
        return None

    def mlp_input_weight(self, rows: int) -> torch.Tensor | None:
        """The same for the MLP (``feed_forward_projected``)."""
        return None

    def feed_forward_projected(self, projected: torch.Tensor, be: Backends) -> torch.Tensor:
        raise NotImplementedError

    def feed_forward_add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, be: Backends
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``norm.add(feed_forward(x), residual)`` where the MLP's last launch can run the norm too, else None."""
        return None

    def prefetch_feed_forward(self, rows: int, be: Backends) -> None:
        """Ask ``be.l2`` for the MLP weights it will read first, as the attention's output is ready (the norm and
        the routing run before the MLP streams them)."""

    def _input_norm(
        self, h: torch.Tensor, residual: torch.Tensor | None, be: Backends
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(input_norm(h + residual), h + residual, False), or with ``projected`` True the norm's output already
        through the attention's first projection (one-row GPU steps: the norm inside that launch)."""
        fused = _norm_in_projection(self.input_layernorm, h, residual, self.attention_input_weight(h.shape[0]), be)
        if fused is not None:
            return fused[0], fused[1], True
        if residual is None:
            return self.input_layernorm(h, be), h, False
        return *self.input_layernorm.add(h, residual, be), False

    def _post_attention_norm(self, rows: int, residual: torch.Tensor, fuse: bool, be: Backends) -> AddNorm | None:
        """The post-attention norm for the attention's output projection to run (``project_norm_after``) where the
        dense backend fuses it at ``rows`` rows and ``fuse`` (the model lets blocks run the norms after them)."""
        if not fuse or not be.dense.fuses_norm_after(rows):
            return None
        norm = self.post_attention_layernorm
        return AddNorm(residual, norm.weight, norm.eps)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        cache: CacheTensors,
        be: Backends,
        normed: bool = False,
        next_norm: RMSNorm | None = None,
    ) -> LayerCarry:
        """(the previous layer's MLP output, the residual sum before it) -> this layer's pair; the layer's
        output is their sum (``layer_output``). residual None: ``h`` is the whole input (the embeddings, or a
        pipeline stage's received hidden states). ``normed``: ``h`` is this layer's input norm's output already
        (the previous layer's ``LayerCarry.normed``). ``next_norm``: the norm that follows this layer (the next
        layer's input norm, or the final one), which the layer may run in its last launch (then ``normed``); given,
        the attention may also run the post-attention norm in its last launch."""
        projected = False
        if not normed:
            h, residual, projected = self._input_norm(h, residual, be)
        assert residual is not None  # a normed input carries the layer's input as its residual
        after = self._post_attention_norm(h.shape[0], residual, next_norm is not None, be)
        kw = {"projected": True} if projected else {}  # an attention without input_weight takes no such argument
        if after is not None:  # one-row GPU steps: the norm in the last program of the output projection
            x, residual = self.self_attn(h, batch, cache, be, norm_after=after, **kw)
            self.prefetch_feed_forward(x.shape[0], be)
        else:
            h = self.self_attn(h, batch, cache, be, **kw)
            self.prefetch_feed_forward(h.shape[0], be)
            mlp_weight = self.mlp_input_weight(h.shape[0])
            fused = _norm_in_projection(self.post_attention_layernorm, h, residual, mlp_weight, be)
            if fused is not None:
                projected_mlp, residual = fused
                return LayerCarry(self.feed_forward_projected(projected_mlp, be), residual)
            x, residual = self.post_attention_layernorm.add(h, residual, be)
        if next_norm is not None and (pair := self.feed_forward_add_norm(x, residual, next_norm, be)) is not None:
            return LayerCarry(*pair, normed=True)
        return LayerCarry(self.feed_forward(x, be), residual)


def _norm_in_projection(
    norm: RMSNorm, h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, be: Backends
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(norm(h + residual) @ weight^T, h + residual) in one launch where the dense backend fuses them, else None."""
    return None if weight is None else be.dense.add_norm_linear(h, residual, norm.weight, norm.eps, weight)


def layer_output(h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """A decoder layer's output from its ``(h, residual)`` pair: the add its next norm would have fused."""
    return h if residual is None else h + residual


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * w * sigmoid(gate), all in fp32 (KDA's output norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor, be: Backends | None = None) -> torch.Tensor:
        return _norms(be).gated_rms_norm(x, gate, self.weight, self.eps)


_REFERENCE = TorchNormBackend()


def _norms(be: Backends | None) -> TorchNormBackend:
    return be.norm if be is not None else _REFERENCE


_MM_OUT_DTYPE_FAILED = False


def router_logits(x: torch.Tensor, weight: torch.Tensor, weight_fp32: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 router logits x @ weight^T (HF's MoE gate runs in fp32: ``F.linear(x.float(), weight.float())``).

    bf16 x and bf16 weight on CUDA: one bf16 GEMM with fp32 accumulation and fp32 output. A product of two
    bf16 values is exact in fp32 and the sums are fp32, without widening x (a copy) or running the GEMM on CUDA
    cores: the SIMT sgemm took 1.4 ms of an 8k prefill (254 vs 38 us a layer) on the H200. The tensor cores'
    fp32 accumulation rounds less tightly than an FMA sgemm: relative RMS error 2.4e-6 against fp64 (the fp32
    GEMM: 1.3e-7), max 2e-5 on logits of ~5, top-8 choice unchanged on every row checked
    (``python -m bench.gpu_kernels_check --only router``). Elsewhere (the CPU reference) exactly HF's form.
    weight_fp32: the weight already in fp32 (cast once at load)."""
    global _MM_OUT_DTYPE_FAILED
    if x.is_cuda and x.dtype == weight.dtype == torch.bfloat16 and not _MM_OUT_DTYPE_FAILED:
        try:
            return torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)
        except (RuntimeError, TypeError, NotImplementedError) as err:  # no mm(out_dtype=) in this torch / device
            _MM_OUT_DTYPE_FAILED = True
            fall_back("torch.mm(out_dtype=float32)", "the MoE router runs HF's fp32 GEMM", err)
    return F.linear(x.float(), weight_fp32 if weight_fp32 is not None else weight.float())


def project(x: torch.Tensor, weight: torch.Tensor, be: Backends | None) -> torch.Tensor:
    """x @ weight^T for an ``nn.Linear`` weight without bias, through the step's dense backend when given (the
    skinny GEMM of decode-sized steps on CUDA), else ``F.linear``."""
    return be.dense.linear(x, weight) if be is not None else F.linear(x, weight)


def project_norm_after(
    x: torch.Tensor, weight: torch.Tensor, norm_after: AddNorm, be: Backends
) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention's output projection followed by the post-attention norm (``norm_after``): one launch where the
    dense backend fuses them (``linear_norm_after``), else the projection, then the norm."""
    fused = be.dense.linear_norm_after(x, weight, norm_after)
    return fused if fused is not None else norm_after_output(project(x, weight, be), norm_after, be)


def norm_after_output(y: torch.Tensor, norm_after: AddNorm, be: Backends) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + y) * w, residual + y)``: the norm after a block, run on its own."""
    return _norms(be).add_rms_norm(y, norm_after.residual, norm_after.weight, norm_after.eps)


class PackedProjection(nn.Module):
    """Several projections of one input as one GEMM: their weights stacked on the output dim in one tensor,
    each original nn.Linear's weight rebound to a view of it (no extra memory; parameter counts unchanged, the
    packed tensor is not a parameter). Fewer launches per layer: on a GPU decode step the count matters."""

    def __init__(self, linears: list[nn.Linear], weight: torch.Tensor | None = None) -> None:
        """weight: a [sum of outputs, in] tensor that already holds the linears' weights stacked (e.g. a slice
        of a larger packed tensor), else they are concatenated into a new one."""
        super().__init__()
        self.sizes = [lin.weight.shape[0] for lin in linears]
        if weight is None:
            weight = torch.cat([lin.weight.data for lin in linears], dim=0)
        elif weight.shape != (sum(self.sizes), linears[0].weight.shape[1]):
            raise ValueError(f"weight must be [{sum(self.sizes)}, {linears[0].weight.shape[1]}], got {weight.shape}")
        self.weight = weight
        for lin, view in zip(linears, self.weight.split(self.sizes, dim=0), strict=True):
            lin.weight = nn.Parameter(view, requires_grad=False)

    def forward(self, x: torch.Tensor, be: Backends | None = None) -> torch.Tensor:
        """[T, sum(sizes)]: the projections' outputs side by side, in the order given."""
        return project(x, self.weight, be)


class GatedMLP(nn.Module):
    """SwiGLU MLP with the HF names gate_proj / up_proj / down_proj."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

        self.gate_up: PackedProjection | None = None

    def pack_weights(self) -> None:
        if self.gate_up is None:  # a MoE block may have packed its shared expert already (SparseMoE.pack_weights)
            self.gate_up = PackedProjection([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor, be: Backends | None = None) -> torch.Tensor:
        if self.gate_up is not None:
            return self.from_gate_up(self.gate_up(x, be), be)
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))

    def add_norm(self, x: torch.Tensor, norm_after: AddNorm, be: Backends) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(norm(residual + mlp(x)), residual + mlp(x))`` with the norm after the MLP (``norm_after``: the next
        layer's input norm, or the final one) run by the down projection's last program, where the dense backend
        fuses it at x's rows (one-row GPU steps, packed weights); else None: the caller runs the norm."""
        if self.gate_up is None or not be.dense.fuses_norm_after(x.shape[0]):
            return None
        return project_norm_after(self._act(self.gate_up(x, be)), self.down_proj.weight, norm_after, be)

    def from_gate_up(self, gate_up: torch.Tensor, be: Backends | None = None) -> torch.Tensor:
        """The rest of the MLP from the packed gate | up projection's output [T, 2I] (``pack_weights``)."""
        return project(self._act(gate_up), self.down_proj.weight, be)

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.gate_up.sizes, dim=-1)
        return silu_mul(gate, up)


class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE over the full head dim, rotate-half convention."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D], positions [T]."""
        freqs = positions[:, None].float() * self.inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype)[:, None, :], emb.sin().to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
