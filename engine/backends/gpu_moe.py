"""The GPU MoE backend: routing with Triton kernels; experts by the step's size (decode kernels, prefill kernels,
or torch's grouped GEMMs); at one token a whole block in two launches. Same results as torch_ref.py's.

Imports triton — only ``select_backends`` on a CUDA device imports this module (through engine/backends/gpu.py).
"""

from __future__ import annotations

import os

import torch

from engine.backends.base import AddNorm, MoEBackend
from engine.backends.fallback import fall_back
from kernels.env import env_switch
from kernels.moe.align import moe_align_auto
from kernels.moe.combine import moe_combine_auto
from kernels.moe.combine_norm import add_rms_norm_reference, moe_combine_add_norm
from kernels.moe.decode import MAX_PAIRS as DECODE_MAX_PAIRS
from kernels.moe.decode import moe_experts_decode
from kernels.moe.down_norm import (
    DOWN_NORM_TICKET_WORDS,
    down_combine_norm,
    moe_experts_decode_add_norm,
    tile_tickets_from_env,
)
from kernels.moe.flag_wait import acquire_poll_from_env
from kernels.moe.grouped import grouped_mm_supported, grouped_moe
from kernels.moe.prefill import moe_experts_prefill
from kernels.moe.route_fused import router_route
from kernels.moe.route_gate_up import SYNC_SIZE, route_gate_up, route_gate_up_down_norm
from kernels.moe.router import route_split_from_env, router_partials
from kernels.moe.triton import sigmoid_topk_route_triton
from kernels.triton_utils import LaunchTicket, is_interpreting

ROUTER_GEMV_MAX_ROWS = 16
"""Steps of at most this many rows may take the split-K router (``GPUMoEBackend.router_logits``)."""
FUSED_ROUTE_MAX_ROWS = 1
"""Steps of at most this many rows route in one launch (``GPUMoEBackend.route_hidden``; its last program routes
the rows one after another, so only one-row steps by default: the case measured, ~7 us of a b1 step on an H100);
``TANDEM_MOE_FUSED_ROUTE_ROWS`` overrides it, 0 turns the fused launch off."""

FOLD_SHARED_MAX_TOKENS = 16
"""Steps of at most this many rows run the shared expert inside the decode kernels (``folds_shared``): at these
sizes an expert's rows fit one row block of the decode tile; ``TANDEM_MOE_FOLD_SHARED=0`` keeps it separate."""


class GPUMoEBackend(MoEBackend):
    """Routing with one Triton kernel; experts by the step's size: decode-sized steps through the two launches
    of kernels/moe/decode.py (measured on an H200 at T=64: 0.61 vs 0.94 ms a layer, docs/PERFORMANCE.md;
    ``TANDEM_MOE_DECODE_KERNELS=0`` turns them off for bf16), longer ones through the tile-scheduled kernels
    of kernels/moe/prefill.py (the gather and SwiGLU fused into the GEMMs; ``TANDEM_MOE_PREFILL_KERNELS=0``
    keeps torch's grouped GEMMs for bf16). One-token steps skip the sorted layout (``moe_experts_decode``'s pair
    rows: one launch a layer fewer; ``TANDEM_MOE_PAIR_ROWS=0`` keeps the align). On Hopper the gate-up GEMM
    reads the weights through TMA (``TANDEM_MOE_GATE_UP_TMA=0``: the pointer kernel), and so does the down GEMM
    below 16k tokens, torch's grouped_mm from there (``TANDEM_MOE_DOWN_IMPL`` = auto | grouped_mm | triton | tma
    overrides, for A / B runs). fp32 on CUDA always takes the kernels: the grouped path would read the group sizes
    on the host."""

    def __init__(
        self,
        experts_impl: str = "auto",
        decode_kernels: bool | None = None,
        prefill_kernels: bool | None = None,
        gate_up_tma: bool | None = None,
        down_impl: str | None = None,
        router_gemv: bool | None = None,
        fused_route_rows: int | None = None,
    ) -> None:
        self.experts_impl = experts_impl
        if decode_kernels is None:
            decode_kernels = env_switch("TANDEM_MOE_DECODE_KERNELS", True)
        if prefill_kernels is None:
            prefill_kernels = env_switch("TANDEM_MOE_PREFILL_KERNELS", True)
        if gate_up_tma is None:
            gate_up_tma = env_switch("TANDEM_MOE_GATE_UP_TMA", True)
        self.decode_kernels = decode_kernels
        self.prefill_kernels = prefill_kernels
        self.gate_up_impl = "auto" if gate_up_tma else "pointer"
        self.down_impl = down_impl or os.environ.get("TANDEM_MOE_DOWN_IMPL", "auto").strip()
        if self.down_impl not in ("auto", "grouped_mm", "triton", "tma"):
            raise ValueError(
                f"MoE down_impl (TANDEM_MOE_DOWN_IMPL) must be auto, grouped_mm, triton or tma, got {self.down_impl!r}"
            )
        self.fold_shared = self.decode_kernels and env_switch("TANDEM_MOE_FOLD_SHARED", True)
        self.pair_rows = env_switch("TANDEM_MOE_PAIR_ROWS", True)
        self.combine_norm = env_switch("TANDEM_MOE_COMBINE_NORM", True)
        self.down_norm = env_switch("TANDEM_MOE_DOWN_NORM", True)
        # the routing inside the gate-up launch at one token (with down_norm): b1 -20 us a step on the H200
        self.route_gate_up = env_switch("TANDEM_MOE_ROUTE_GATE_UP", True)
        # its routed programs poll a word holding their expert instead of the flag (b1 +7-9 us a step on an H100)
        self.route_slot_words = env_switch("TANDEM_MOE_ROUTE_SLOT_WORDS", False)
        # the down programs in that launch too: the whole block one launch (+75 us a b1 step on an H100: off)
        self.block_one_launch = env_switch("TANDEM_MOE_BLOCK_ONE_LAUNCH", False)
        self.route_split = route_split_from_env()
        self.route_acquire = acquire_poll_from_env()  # read here: a bad value fails at start, not as a fallback
        self.down_tile_tickets = tile_tickets_from_env()  # the down launch's two-level combine + norm tail
        if router_gemv is None:
            router_gemv = env_switch("TANDEM_MOE_ROUTER_GEMV", False)
        self.router_gemv = router_gemv
        if fused_route_rows is None:
            rows = os.environ.get("TANDEM_MOE_FUSED_ROUTE_ROWS", str(FUSED_ROUTE_MAX_ROWS)).strip()
            if not rows.isdigit():
                raise ValueError(f"TANDEM_MOE_FUSED_ROUTE_ROWS must be a row count (0: off), got {rows!r}")
            fused_route_rows = int(rows)
        self.fused_route_rows = min(fused_route_rows, 64)  # kernels/moe/route_fused.py takes up to 64 rows
        # the launches whose last program finishes the work (the router + top-k, the down + combine + norm):
        # serial on the step's stream, each leaves it at 0
        self._ticket = LaunchTicket()
        self._down_ticket = LaunchTicket(DOWN_NORM_TICKET_WORDS)  # the down + norm's, with its column-tile words
        self._sync = LaunchTicket(SYNC_SIZE)  # kernels/moe/route_gate_up.py's counters
        self._decode_failed = False
        self._prefill_failed = False

    def _decode_path(self, x: torch.Tensor) -> bool:
        """Opted in, or the only path without host syncs: torch's grouped GEMM is bf16-only and the
        per-expert loop it falls back to (fp32) reads the group sizes on the host, which a decode CUDA
        graph cannot hold."""
        return not self._decode_failed and (self.decode_kernels or self._grouped_needs_host(x))

    def _prefill_path(self, x: torch.Tensor) -> bool:
        return not self._prefill_failed and (self.prefill_kernels or self._grouped_needs_host(x))

    @staticmethod
    def _grouped_needs_host(x: torch.Tensor) -> bool:
        return x.is_cuda and not grouped_mm_supported(x)

    @staticmethod
    def _router_kernels_take(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the router's Triton kernels (kernels/moe/router.py, route_fused.py) can run on x and weight."""
        return (x.is_cuda or is_interpreting()) and x.stride(-1) == 1 and weight.stride(-1) == 1

    def router_logits(
        self, x: torch.Tensor, weight: torch.Tensor, weight_fp32: torch.Tensor | None = None
    ) -> torch.Tensor:
        """At most ``ROUTER_GEMV_MAX_ROWS`` rows with ``router_gemv`` (``TANDEM_MOE_ROUTER_GEMV=1``): the router as
        split-K partial sums (kernels/moe/router.py), which ``route`` adds as it loads them; off by default until
        measured on the H200 against cuBLAS's 5.7 us a layer."""
        small = 0 < x.shape[0] <= ROUTER_GEMV_MAX_ROWS and x.dtype == weight.dtype
        if self.router_gemv and small and self._router_kernels_take(x, weight):
            return router_partials(x, weight)
        return super().router_logits(x, weight, weight_fp32)

    def route_hidden(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_fp32: torch.Tensor | None,
        correction_bias: torch.Tensor | None,
        top_k: int,
        renormalize: bool,
        scaling_factor: float,
        extra_expert: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps of at most ``fused_route_rows`` rows: the router GEMV and the top-k in one launch
        (kernels/moe/route_fused.py: the split-K router's partials, added in split order by its last program, so
        the same routing as ``TANDEM_MOE_ROUTER_GEMV=1``'s two launches). The ticket is made on the first call of
        any size, which is an eager prefill before any decode graph is captured."""
        if self._router_kernels_take(x, weight) and x.ndim == 2:
            ticket = self._ticket.get(x.device)
            self._sync.get(x.device)  # made here too, eagerly: one-token steps may be captured at once
            self._down_ticket.get(x.device)
            if 0 < x.shape[0] <= self.fused_route_rows and x.dtype == weight.dtype:
                return router_route(
                    x, weight, ticket, correction_bias, top_k, renormalize, scaling_factor, extra_expert=extra_expert
                )
        return super().route_hidden(
            x, weight, weight_fp32, correction_bias, top_k, renormalize, scaling_factor, extra_expert=extra_expert
        )

    def route(
        self,
        router_logits: torch.Tensor,
        correction_bias: torch.Tensor | None,
        top_k: int,
        renormalize: bool,
        scaling_factor: float,
        extra_expert: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return sigmoid_topk_route_triton(
            router_logits.contiguous(), correction_bias, top_k, renormalize, scaling_factor, extra_expert=extra_expert
        )

    def folds_shared(self, num_tokens: int) -> bool:
        """Decode-sized steps (at most ``FOLD_SHARED_MAX_TOKENS`` rows) on the decode kernels: the shared expert is
        one more expert there, with one row block like the routed ones (``decode_tiles``), instead of its own
        gate-up GEMM, SwiGLU and down GEMM. Longer steps keep it separate (its rows would walk its weights once
        per row block, the longest program of the launch)."""
        return self.fold_shared and 0 < num_tokens <= FOLD_SHARED_MAX_TOKENS and not self._decode_failed

    def fuses_add_norm(self, num_tokens: int) -> bool:
        """One-token steps on the pair-row decode kernels with the shared expert folded: the combine runs the next
        layer's input norm (or the final norm) in its launch, one launch a MoE layer fewer
        (kernels/moe/combine_norm.py; ``TANDEM_MOE_COMBINE_NORM=0`` keeps the norm's own launch). Its combine + norm
        runs in the down launch's last program (kernels/moe/down_norm.py; ``TANDEM_MOE_DOWN_NORM=0``: its own
        launch)."""
        return self.combine_norm and self.pair_rows and num_tokens == 1 and self.folds_shared(num_tokens)

    def route_experts_add_norm(
        self,
        x: torch.Tensor,
        router_weight: torch.Tensor,
        router_weight_fp32: torch.Tensor | None,
        correction_bias: torch.Tensor | None,
        top_k: int,
        renormalize: bool,
        scaling_factor: float,
        extra_expert: int,
        experts: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        add_norm: AddNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token: the block in two launches, the routing inside the gate-up's (kernels/moe/route_gate_up.py)
        and the combine + norm inside the down's; with ``TANDEM_MOE_BLOCK_ONE_LAUNCH=1`` all of it in one launch
        (``route_gate_up_down_norm``; the flag form only). ``TANDEM_MOE_ROUTE_GATE_UP=0`` (or anything the fused
        launch does not take): the routing's own launch, then ``experts_add_norm``."""
        an, (_, _, w2, w13) = add_norm, experts
        fits = x.shape[0] == 1 and x.dtype == router_weight.dtype
        on = self.route_gate_up and self.down_norm and self.fused_route_rows > 0
        if on and fits and self._router_kernels_take(x, router_weight):
            try:
                x_row = x if x.stride(1) == 1 else x.contiguous()
                sync, ticket = self._sync.get(x.device), self._down_ticket.get(x.device)
                if self.block_one_launch and not self.route_slot_words:
                    return route_gate_up_down_norm(
                        x_row, router_weight, sync, correction_bias, top_k, renormalize, scaling_factor, w13, w2,
                        an.residual, an.weight, an.eps, extra_expert, split=self.route_split,
                        acquire=self.route_acquire,
                    )  # fmt: skip
                weights, ids, a = route_gate_up(
                    x_row, router_weight, sync, correction_bias, top_k, renormalize, scaling_factor, w13, extra_expert,
                    split=self.route_split, slot_words=self.route_slot_words, acquire=self.route_acquire,
                )  # fmt: skip
                return down_combine_norm(
                    a, ids.reshape(-1), w2, weights, an.residual, an.weight, an.eps, ticket,
                    tile_tickets=self.down_tile_tickets,
                )  # fmt: skip
            except Exception as err:  # the routing's own launch from here on
                self.route_gate_up = False
                fall_back("MoE route + gate-up launch", "one-token steps route in a launch of their own", err)
        return super().route_experts_add_norm(
            x, router_weight, router_weight_fp32, correction_bias, top_k, renormalize, scaling_factor, extra_expert,
            experts, add_norm,
        )  # fmt: skip

    def experts_add_norm(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        w1: torch.Tensor,
        w3: torch.Tensor,
        w2: torch.Tensor,
        w13: torch.Tensor,
        add_norm: AddNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        an = add_norm
        try:
            x_row = x if x.stride(1) == 1 else x.contiguous()
            if self.down_norm:  # the combine + norm in the down launch's last program
                ticket = self._down_ticket.get(x.device)
                return moe_experts_decode_add_norm(
                    x_row, w13, w2, ids.reshape(-1), weights, an.residual, an.weight, an.eps, ticket,
                    tile_tickets=self.down_tile_tickets,
                )  # fmt: skip
            y = moe_experts_decode(x_row, None, w13, w2, ids=ids.reshape(-1))
            return moe_combine_add_norm(y, None, weights, an.residual, an.weight, an.eps, x.dtype)
        except Exception as err:  # as in experts: the grouped path for good, the norm in torch after it
            self._decode_failed = True
            fall_back("MoE decode kernels", "decode steps use the grouped path", err)
        return add_rms_norm_reference(self.experts(x, weights, ids, w1, w3, w2, w13), an.residual, an.weight, an.eps)

    def experts(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        w1: torch.Tensor,
        w3: torch.Tensor,
        w2: torch.Tensor,
        w13: torch.Tensor | None = None,
        add: torch.Tensor | None = None,
    ) -> torch.Tensor:
        pairs = ids.numel()
        if w13 is not None and 0 < pairs <= DECODE_MAX_PAIRS and self._decode_path(x):
            try:
                x_rows = x if x.stride(1) == 1 else x.contiguous()
                if self.pair_rows and x.shape[0] == 1:  # one token: its experts are distinct, no sort needed
                    y = moe_experts_decode(x_rows, None, w13, w2, ids=ids.reshape(-1))
                    return moe_combine_auto(y, None, weights, x.dtype, add)
                al = moe_align_auto(ids, w13.shape[0])
                y = moe_experts_decode(x_rows, al, w13, w2, ids=ids.reshape(-1))
                return moe_combine_auto(y, al.rows_of_pairs(), weights, x.dtype, add)
            except Exception as err:  # e.g. a compile failure on an untried GPU: the grouped path, for good
                self._decode_failed = True
                fall_back("MoE decode kernels", "decode steps use the grouped path", err)
        if w13 is not None and pairs > DECODE_MAX_PAIRS and self._prefill_path(x):
            try:
                al = moe_align_auto(ids, w13.shape[0])
                x_rows = x if x.stride(1) == 1 else x.contiguous()
                y = moe_experts_prefill(x_rows, al, w13, w2, gate_up_impl=self.gate_up_impl, down_impl=self.down_impl)
                return moe_combine_auto(y, al.rows_of_pairs(), weights, x.dtype, add)
            except Exception as err:  # as above: the grouped path, for good
                self._prefill_failed = True
                fall_back("MoE prefill kernels", "long steps use the grouped path", err)
        y = grouped_moe(
            x, weights, ids, w1, w3, w2, impl=self.experts_impl, w13=w13, align=moe_align_auto, combine=moe_combine_auto
        )
        return y if add is None else y + add


__all__ = ["FOLD_SHARED_MAX_TOKENS", "FUSED_ROUTE_MAX_ROWS", "ROUTER_GEMV_MAX_ROWS", "GPUMoEBackend"]
