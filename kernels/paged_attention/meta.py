"""Launch metadata of the paged-attention kernel (kernels/paged_attention/triton.py): which programs run,
over which rows, keys and query positions. Built on the host from a step's lists with one host->device
copy, once per step; every layer of the step reuses it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.triton_utils import next_pow2
from kernels.upload import upload


@dataclass
class AttnMeta:
    """Device-side description of one launch over a subset of a batch's sequences.

    qsl [n+1]: row starts of each sequence in this launch's q / out tensors (compacted);
    ctx [n]: context length after this step; block_tables [n, P] (paged) or kv_start [n] (contiguous K/V);
    work [W, 2]: (sequence, first row) per program along grid axis 0;
    qpos0 [n] (optional): position of each sequence's first query token, the others following every
    ``pos_stride`` positions (None: the last q_len positions, stride 1).
    """

    qsl: torch.Tensor
    ctx: torch.Tensor
    block_tables: torch.Tensor | None
    kv_start: torch.Tensor | None
    work: torch.Tensor
    num_seqs: int
    num_tokens: int
    max_q_len: int
    max_ctx: int
    group: int
    block_m: int
    qpos0: torch.Tensor | None = None
    pos_stride: int = 1


def pack_block_tables(block_tables: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """N per-sequence page lists -> [N, max_pages] int32 (zero padded; padding is never read).

    One cat + one scatter on the device whatever N is (lengths are read from shapes, no sync).
    """
    n = len(block_tables)
    lens = [int(t.shape[0]) for t in block_tables]
    width = max(lens, default=0)
    out = torch.zeros(n, max(width, 1), dtype=torch.int32, device=device)
    if width == 0:
        return out
    flat = torch.cat([upload(t.reshape(-1), device) for t in block_tables]).to(torch.int32)
    idx = torch.cat([torch.arange(length, dtype=torch.int64) + i * out.shape[1] for i, length in enumerate(lens)])
    out.view(-1)[upload(idx, device)] = flat
    return out


def build_attn_meta(
    q_lens: Sequence[int],
    context_lens: Sequence[int],
    group: int,
    block_m: int,
    device: torch.device,
    block_tables: torch.Tensor | None = None,
    kv_start: Sequence[int] | None = None,
    q_pos0: Sequence[int] | None = None,
    pos_stride: int = 1,
) -> AttnMeta:
    """Metadata for ``attention_fwd``. ``q_lens`` / ``context_lens`` are per sequence (host lists);
    pass the packed ``block_tables`` [n, P] for paged K/V or ``kv_start`` for contiguous K/V.

    Query token ``j`` of sequence ``i`` is at position ``q_pos0[i] + j * pos_stride`` (strided positions, PCP:
    a rank's share of a round-robin striped chunk); the default ``q_pos0=None`` means the last ``q_len``
    positions (``context_len - q_len``, stride 1). Keys always cover the whole context."""
    n = len(context_lens)
    if len(q_lens) != n:
        raise ValueError(f"{len(q_lens)} q_lens but {n} context_lens")
    if pos_stride < 1:
        raise ValueError(f"pos_stride must be >= 1, got {pos_stride}")
    if q_pos0 is None and pos_stride != 1:
        raise ValueError(f"pos_stride {pos_stride} needs q_pos0 (the default positions are the last q_len, stride 1)")
    if q_pos0 is not None and len(q_pos0) != n:
        raise ValueError(f"{len(q_pos0)} q_pos0 but {n} context_lens")
    qsl = [0]
    work: list[tuple[int, int, int]] = []
    for i, (ql, ctx) in enumerate(zip(q_lens, context_lens, strict=True)):
        if ql < 0 or ql > ctx:
            raise ValueError(f"sequence {i}: q_len {ql} must be in [0, context_len {ctx}]")
        if q_pos0 is None:
            p0 = ctx - ql
        else:
            p0 = q_pos0[i]
            if p0 < 0:
                raise ValueError(f"sequence {i}: q_pos0 {p0} must be >= 0")
            if ql > 0 and p0 + (ql - 1) * pos_stride >= ctx:
                raise ValueError(
                    f"sequence {i}: last query position {p0} + ({ql} - 1) * {pos_stride} = "
                    f"{p0 + (ql - 1) * pos_stride} must be < context_len {ctx}"
                )
        qsl.append(qsl[-1] + ql)
        for r0 in range(0, ql * group, block_m):
            last_tok = (min(r0 + block_m, ql * group) - 1) // group
            work.append((p0 + last_tok * pos_stride + 1, i, r0))  # keys this program reads
    work.sort(key=lambda w: -w[0])  # longest first: better tail for causal prefill
    ints = qsl + list(context_lens) + [x for _, i, r0 in work for x in (i, r0)]
    if kv_start is not None:
        ints += list(kv_start)
    if q_pos0 is not None:
        ints += list(q_pos0)
    host = torch.tensor(ints, dtype=torch.int32)
    dev = upload(host, device)
    o = 0
    qsl_t, o = dev[o : o + n + 1], o + n + 1
    ctx_t, o = dev[o : o + n], o + n
    work_t, o = dev[o : o + 2 * len(work)].view(-1, 2), o + 2 * len(work)
    kvs_t, o = (dev[o : o + n], o + n) if kv_start is not None else (None, o)
    qp0_t = dev[o : o + n] if q_pos0 is not None else None
    return AttnMeta(
        qsl=qsl_t,
        ctx=ctx_t,
        block_tables=block_tables,
        kv_start=kvs_t,
        work=work_t,
        num_seqs=n,
        num_tokens=qsl[-1],
        max_q_len=max(q_lens, default=0),
        max_ctx=max(context_lens, default=0),
        group=group,
        block_m=block_m,
        qpos0=qp0_t,
        pos_stride=pos_stride,
    )


def default_block_m(group: int, max_q_len: int, dv: int) -> int:
    """Rows per program: the launch's rows rounded up to a power of 2 in [16, 64] (16 is the smallest tl.dot
    tile); 16 when the value is wider than 256 (MLA's latent: a [16, 512] fp32 accumulator already fills
    the registers)."""
    cap = 16 if dv > 256 else 64
    return min(cap, max(16, next_pow2(max_q_len * group)))


def plan_gqa(
    query_start_loc: Sequence[int],
    context_lens: Sequence[int],
    block_tables: torch.Tensor,
    group: int,
    device: torch.device,
    head_dim: int = 128,
    q_pos0: Sequence[int] | None = None,
    pos_stride: int = 1,
) -> AttnMeta:
    """Metadata of a GQA step (``block_tables`` packed [N, P]); built once per step, reused by every layer.
    ``q_pos0`` / ``pos_stride``: strided query positions (``build_attn_meta``)."""
    q_lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(context_lens))]
    block_m = default_block_m(group, max(q_lens, default=0), head_dim)
    return build_attn_meta(
        q_lens, context_lens, group, block_m, device, block_tables=block_tables, q_pos0=q_pos0, pos_stride=pos_stride
    )


def attention_flops(q_lens: Sequence[int], context_lens: Sequence[int], heads: int, d_qk: int, d_v: int) -> float:
    """Useful causal FLOPs (2 per MAC) of a varlen batch, for benchmarks."""
    pairs = sum(ql * ctx - ql * (ql - 1) / 2 for ql, ctx in zip(q_lens, context_lens, strict=True))
    return 2.0 * pairs * heads * (d_qk + d_v)


__all__ = ["AttnMeta", "attention_flops", "build_attn_meta", "default_block_m", "pack_block_tables", "plan_gqa"]
