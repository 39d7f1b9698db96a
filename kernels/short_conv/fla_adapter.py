"""Long prefill chunks' short conv through fla-core's ``causal_conv1d``. Contract: kernels/short_conv/naive.py.

On an H200 (``python -m bench.short_conv_sweep``, q|k|v of Kimi-Linear: 12,288 channels, bf16) fla's kernel
ran an 8k / 32k-token chunk in 230 / 598 us (41 / 63 % of copy bandwidth), the slot kernel at its best tiles
in 415 / 1,625 us: fla gives each 64-token tile its own program, ours walks a chunk of tiles per program. fla
has no state slots, so the windows are gathered into its ``initial_state`` [N, C, W] (column 0 unused: it reads
columns 1..W-1, oldest first, our window's order) and the new windows are written by the slot kernel's state
launch (``write_windows``) after the conv has read the old ones (same stream). Decode and spec verify keep the
slot kernel (one launch, graph-safe, in-place windows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels.fla_chunks import CHUNK, ChunkLayout, chunk_layout
from kernels.upload import Upload, upload

FLA_TILE = CHUNK
"""fla's tokens per program (its ``chunk_size``); chunk_indices are built for it."""


@dataclass(frozen=True)
class ConvStep:
    """A step's varlen layout for fla, built once per step (host lists in, device tensors out, no sync)."""

    slots: torch.Tensor  # [N] int32
    slots_long: torch.Tensor  # [N] int64, for the window gather
    qsl: torch.Tensor  # [N+1] int32
    has_init: torch.Tensor  # [N] int32
    tables: ChunkLayout  # fla's (sequence, tile) table and offsets: the same tables the KDA kernels take
    any_init: bool

    @property
    def cu(self) -> torch.Tensor:  # [N+1] int64 on the device
        return self.tables.cu

    @property
    def cu_cpu(self) -> torch.Tensor:  # [N+1] int64 on the host (fla reads lengths from it)
        return self.tables.cu_cpu

    @property
    def chunk_indices(self) -> torch.Tensor:  # [NT, 2] int64 (sequence, tile) of each of fla's programs
        return self.tables.chunk_indices


def conv_step(
    slots: Sequence[int], qsl: Sequence[int], has_init: Sequence[bool], device: torch.device, up: Upload = upload
) -> ConvStep:
    """``up``: a ``StaticUploads`` keeps every device tensor at a fixed address (a CUDA graph's metadata)."""
    n = len(slots)
    if len(qsl) != n + 1 or len(has_init) != n or min(slots, default=0) < 0:
        raise ValueError(f"fla conv needs N real slots and N+1 offsets, got {list(slots)}, {list(qsl)}")
    ints = list(slots) + list(qsl) + [int(b) for b in has_init]
    dev32 = up(torch.tensor(ints, dtype=torch.int32), device)
    return ConvStep(
        slots=dev32[:n],
        slots_long=up(torch.tensor(list(slots), dtype=torch.int64), device),  # uploaded, not cast: a fixed address
        qsl=dev32[n : 2 * n + 1],
        has_init=dev32[2 * n + 1 :],
        tables=chunk_layout(qsl, device, up),
        any_init=any(has_init),
    )


def launch_fla_conv(x: torch.Tensor, weight: torch.Tensor, init: torch.Tensor | None, step: ConvStep) -> torch.Tensor:
    """fla's ``causal_conv1d_fwd_kernel`` with SiLU over one plane: x [T, D] (unit stride on D, any row
    stride), weight [D, W] and init [N, D, W] contiguous (fla's window layout) or None; returns y [T, D].

    The launch ``causal_conv1d`` makes, without its wrappers (dispatch, input guard, autograd, kwarg shims: under
    cProfile 10 ms for the 18 calls of an 8k prefill, ~6 of them in the launches; the step is host-bound) and
    with the step's tile table instead of one built per call."""
    import triton
    from fla.modules.causal_conv1d.ops import causal_conv1d_fwd_kernel

    t, d = x.shape
    w = weight.shape[1]
    y = torch.empty(t, d, dtype=x.dtype, device=x.device)
    nt = step.chunk_indices.shape[0]

    def grid(meta: dict) -> tuple[int, int, int]:
        return (triton.cdiv(d, meta["BD"]), nt, 1)

    causal_conv1d_fwd_kernel[grid](
        x=x,
        y=y,
        weight=weight,
        bias=None,
        residual=None,
        cu_seqlens=step.cu,
        initial_state=init,
        chunk_indices=step.chunk_indices,
        B=1,
        T=t,
        stride_x_n=t * x.stride(0),
        stride_x_t=x.stride(0),
        stride_x_d=1,
        D=d,
        W=w,
        BT=FLA_TILE,
        BW=triton.next_power_of_2(w),
        ACTIVATION="silu",
    )
    return y


PlaneConv = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", ConvStep], torch.Tensor]


def short_conv_prefill_fla(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    step: ConvStep,
    conv1d: PlaneConv | None = None,
    planes: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """y = SiLU(causal depthwise conv) of a varlen batch from each slot's window, and the windows updated —
    the plain contract of ``short_conv_update``. x [T, C] (unit stride on C; a column view is fine), weight
    [C, W], conv_state [slots, C, S >= W-1]. ``conv1d``: ``launch_fla_conv`` (tests pass its contract).
    planes=G > 1: one fla launch per G-th of the channels (fla reads the column view in place), returning G
    contiguous [T, C/G] outputs (Kimi's q, k, v: fla's KDA kernels would copy column views of one output)."""
    from kernels.short_conv.triton import write_windows

    if x.ndim != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1], weight.shape[1]):
        raise ValueError(f"x [T, C] with a unit stride on C and weight [C, W]; got {x.shape}, {weight.shape}")
    n, c, w = step.slots.numel(), x.shape[1], weight.shape[1]
    if planes < 1 or c % planes:
        raise ValueError(f"planes must divide the {c} channels, got {planes}")
    p = c // planes
    init = None
    if step.any_init:  # fla's layout per plane: [N, P, W], the window in columns 1..W-1; zeros for a first chunk
        init = conv_state.new_zeros(planes, n, p, w)
        old = conv_state.index_select(0, step.slots_long)[:, :, : w - 1].unflatten(1, (planes, p)).transpose(0, 1)
        init[..., 1:] = torch.where(step.has_init.bool()[None, :, None, None], old, 0)  # fresh slots may hold junk
    fn = conv1d or launch_fla_conv
    weight = weight.contiguous()
    ys = tuple(
        fn(x[:, j * p : (j + 1) * p], weight[j * p : (j + 1) * p], None if init is None else init[j], step)
        for j in range(planes)
    )
    write_windows(x, weight, conv_state, step.slots, step.qsl, step.has_init)
    return ys[0] if planes == 1 else ys


__all__ = ["FLA_TILE", "ConvStep", "PlaneConv", "conv_step", "launch_fla_conv", "short_conv_prefill_fla"]
