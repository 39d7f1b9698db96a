"""Absorbed-MLA decode through FlashMLA's sm90 split-KV kernel: the same contract as
``kernels.paged_attention.mla_decode.mla_decode_fwd`` (which stays the reference-checked Triton path and the
fallback), for bf16 latent caches in pages of 64 on Hopper.

Why a library kernel here: the Triton all-heads kernel reads the latent at ~46 % of the H200's copy bandwidth
at 64 x 32k (docs/PERFORMANCE.md, eighteenth session); FlashMLA's warp-specialised TMA + wgmma pipeline is
the kernel vLLM and SGLang run for this exact shape (one latent "KV head", 512 + 64 dims).

``TANDEM_MLA_DECODE_IMPL``: ``auto`` (default: FlashMLA for every decode launch it can take — bf16 latent in
pages of 64 on sm90 — when its extension is built or buildable, else Triton; the choice is logged once),
``triton``, or ``flashmla`` (forced: an unusable cache or a failed build raises instead of falling back).

The split plan: Tandem's own (kernels/flashmla/plan.py, ``TANDEM_FLASHMLA_PARTS``), or FlashMLA's planner with
``TANDEM_FLASHMLA_PARTS=flashmla``.

The combine of a request's splits: Tandem's Triton kernel (kernels/flashmla/combine.py) after FlashMLA's split
kernel alone, or FlashMLA's own ``combine.cu`` (``TANDEM_FLASHMLA_COMBINE``: ``auto``, the default, takes
Triton's for batches of at most ``TRITON_COMBINE_MAX_BATCH`` where the extension binds the split kernel alone and
Tandem planned; ``triton`` / ``flashmla`` force one).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from kernels.flashmla.build import load_flashmla, missing_sources, source_dir

log = logging.getLogger(__name__)

PAGE_SIZE = 64  # FlashMLA's dense kernel reads whole 64-row pages (TORCH_CHECK in its interface)
RANK, ROPE = 512, 64


def mla_decode_impl() -> str:
    impl = os.environ.get("TANDEM_MLA_DECODE_IMPL", "auto")
    if impl not in ("auto", "triton", "flashmla"):
        raise ValueError(f"TANDEM_MLA_DECODE_IMPL must be 'auto', 'triton' or 'flashmla', got {impl!r}")
    return impl


COMBINE_ENV = "TANDEM_FLASHMLA_COMBINE"
TRITON_COMBINE_MAX_BATCH = 4
"""Auto takes the Triton combine up to this batch: FlashMLA's walks ~132 / batch splits a head serially, which
costs most at batch 1 (one launch of split + combine on the H100, ``python -m bench.flashmla_parts``: 1 x 32k 41.8
-> 31.3 us, 1 x 4k 18.0 -> 16.5), while from batch 16 its few splits a request beat the Triton kernel's one
program per (request, head, 128 dims) (16 x 4k 41.0 -> 48.3 us, 64 x 4k 117.5 -> 146.5; docs/PERFORMANCE.md,
thirtieth session)."""


def combine_impl() -> str:
    impl = os.environ.get(COMBINE_ENV, "auto")
    if impl not in ("auto", "triton", "flashmla"):
        raise ValueError(f"{COMBINE_ENV} must be 'auto', 'triton' or 'flashmla', got {impl!r}")
    return impl


def _triton_combine(ext, planned: bool, batch: int) -> bool:
    """Whether this launch runs FlashMLA's split kernel alone and combines in Triton (``TANDEM_FLASHMLA_COMBINE``)."""
    impl = combine_impl()
    if impl == "flashmla" or (impl == "auto" and batch > TRITON_COMBINE_MAX_BATCH):
        return False
    usable = planned and hasattr(ext, "dense_decode_split_fwd")
    if impl == "triton" and not usable:
        why = (
            "the built extension predates dense_decode_split_fwd: rebuild it (python -m kernels.flashmla.build)"
            if planned
            else "FlashMLA plans itself (TANDEM_FLASHMLA_PARTS=flashmla)"
        )
        raise ValueError(f"{COMBINE_ENV}=triton, but {why}")
    return usable


@functools.cache
def _flashmla_loads() -> bool:
    """Auto mode: is the extension importable here (prebuilt, or built now from the pinned sources)?"""
    if not os.environ.get("TANDEM_FLASHMLA_SO") and missing_sources(source_dir()):
        log.info("MLA decode: Triton (no FlashMLA build or sources at %s)", source_dir())
        return False
    try:
        load_flashmla()
    except Exception as e:  # a failed build must not take the decode service down: Triton is exact too
        first = (str(e).splitlines() or [type(e).__name__])[0]
        log.warning("MLA decode: Triton (FlashMLA failed to build or load: %s)", first)
        return False
    log.info("MLA decode: FlashMLA (sm90 dense decode)")
    return True


def use_flashmla(latent_cache: torch.Tensor, num_heads: int) -> bool:
    """Whether a decode launch over this cache goes to FlashMLA (``TANDEM_MLA_DECODE_IMPL``)."""
    impl = mla_decode_impl()
    if impl != "auto":
        return impl == "flashmla"
    return flashmla_unusable(latent_cache, num_heads) is None and _flashmla_loads()


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def flashmla_unusable(latent_cache: torch.Tensor, num_heads: int) -> str | None:
    """Why FlashMLA cannot take this cache (None: it can)."""
    if not latent_cache.is_cuda:
        return "the latent cache is not on a CUDA device"
    major, minor = _capability(latent_cache.device)
    if (major, minor) != (9, 0):
        return f"FlashMLA's dense decode needs sm90, this GPU is sm{major}{minor}"
    if latent_cache.dtype != torch.bfloat16:
        return f"the latent cache is {latent_cache.dtype}, the build is bf16 only"
    if latent_cache.ndim != 3 or latent_cache.shape[1:] != (PAGE_SIZE, RANK + ROPE):
        return f"the latent cache must be [pages, {PAGE_SIZE}, {RANK + ROPE}], got {tuple(latent_cache.shape)}"
    if latent_cache.stride(2) != 1:
        return "the latent cache needs a unit stride on its last axis"
    if num_heads > 128:
        return f"{num_heads} query heads (FlashMLA takes up to 128 per latent head)"
    return None


def _split_plan(
    ctx_lens: torch.Tensor, num_heads: int, num_parts: int | None, min_blocks: int | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Tandem's split plan for this launch (kernels/flashmla/plan.py), or None where FlashMLA plans itself."""
    # Imported here, not at the top: the planner is a Triton kernel, and on a CPU test machine it must be defined
    # under the interpreter, which tests/kernels/conftest.py sets only around its own imports and the tests.
    from kernels.flashmla import plan

    grid = plan.flashmla_grid_parts(ctx_lens.device, num_heads)
    parts = plan.num_parts_for(ctx_lens.shape[0], grid) if num_parts is None else num_parts
    if parts is None:
        return None
    return plan.even_blocks_plan(ctx_lens, parts, grid, plan.min_blocks_setting() if min_blocks is None else min_blocks)


class DecodeSchedule:
    """The split plan for one step's decode launch, shared by the step's MLA layers.

    The plan (Tandem's planner, or FlashMLA's one-warp kernel whose serial loop took ~26 us on the H200: as long
    as the attention kernel itself at batch 1-16) depends only on the lengths, the batch and the head count: the
    same for every MLA layer of a step. vLLM plans once per step in its metadata builder; here the first layer of
    a forward pass plans and the others reuse it.
    ``owner`` is the planning layer: when it runs again over the same batch (a CUDA graph's warm-up passes,
    then its capture) it plans again, so every pass — and every captured graph — holds its own planning kernel.
    """

    def __init__(self) -> None:
        self.owner: int | None = None
        self.plan: tuple[torch.Tensor, torch.Tensor] | None = None

    def take(self, owner: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The plan to reuse, or None when ``owner`` must plan now (it becomes the owner)."""
        if self.plan is not None and self.owner != owner:
            return self.plan
        self.owner, self.plan = owner, None
        return None


def flashmla_decode_fwd(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    schedule: DecodeSchedule | None = None,
    q: torch.Tensor | None = None,
    num_parts: int | None = None,
    min_blocks: int | None = None,
) -> torch.Tensor:
    """``softmax((q_lat c^T + q_pe pe^T) scale) c`` for one query per sequence, as ``mla_decode_fwd``.

    q_lat [B, H, 512], q_pe [B, H, 64] bf16; latent_cache [num_pages, 64, 576]; block_tables [B, max_pages]
    int32; ctx_lens [B] int32 on the device (read there: no host sync, so a CUDA graph can replay it with new
    lengths — the split plan is computed from them on the device too). Returns o_lat [B, H, 512].
    schedule: the step's shared plan (``DecodeSchedule``; None: plan in this call). q: a contiguous
    [B, H, 576] buffer whose slices q_lat / q_pe already are (written there by their producers; None: concatenated
    here). num_parts: plan over this many parts (None: ``TANDEM_FLASHMLA_PARTS``'s policy; a given count wins
    over ``flashmla`` there), when this call plans; min_blocks: the fewest key blocks a part takes (None:
    ``TANDEM_FLASHMLA_MIN_BLOCKS``).
    """
    b, h, r = q_lat.shape
    why = flashmla_unusable(latent_cache, h)
    if why is not None:
        raise ValueError(f"flashmla_decode_fwd: {why}")
    if q_pe.shape != (b, h, ROPE) or r != RANK or q_lat.dtype != latent_cache.dtype or q_pe.dtype != q_lat.dtype:
        raise ValueError(
            f"q_lat {q_lat.dtype} {tuple(q_lat.shape)} / q_pe {q_pe.dtype} {tuple(q_pe.shape)} must be "
            f"[B, H, {RANK}] / [B, H, {ROPE}] in the cache's {latent_cache.dtype}"
        )
    if q is not None and (
        q.shape != (b, h, RANK + ROPE)
        or not q.is_contiguous()
        or q_lat.data_ptr() != q.data_ptr()
        or q_pe.data_ptr() != q[..., RANK:].data_ptr()
    ):
        raise ValueError("q must be the contiguous [B, H, 576] buffer whose slices q_lat / q_pe are")
    if block_tables.dtype != torch.int32 or block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(
            f"block_tables must be int32 [{b}, max_pages], got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if ctx_lens.dtype != torch.int32 or ctx_lens.shape != (b,):
        raise ValueError(f"ctx_lens must be int32 [{b}], got {ctx_lens.dtype} {tuple(ctx_lens.shape)}")
    if b == 0:
        return q_lat.new_empty(0, h, r) if out is None else out
    q = (torch.cat([q_lat, q_pe], dim=-1) if q is None else q).unsqueeze(1)  # [B, 1, H, 576]: FlashMLA's layout
    ctx_lens = ctx_lens.contiguous()
    shared = schedule.take(latent_cache.data_ptr()) if schedule is not None else None
    plan = shared if shared is not None else _split_plan(ctx_lens, h, num_parts, min_blocks)
    ext = load_flashmla()
    kcache = latent_cache.unsqueeze(2)  # [pages, 64, 1 latent head, 576]
    tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    if _triton_combine(ext, plan is not None, b):
        from kernels.flashmla.combine import split_combine  # a Triton module: imported on use (see _split_plan)

        sched_meta, num_splits = plan
        o, lse_accum, o_accum = ext.dense_decode_split_fwd(q, kcache, r, ctx_lens, tables, float(scale), *plan)
        split_combine(o_accum, lse_accum, num_splits, o, max_splits=sched_meta.shape[0])
    else:
        o, _lse, sched_meta, num_splits = ext.dense_decode_fwd(
            q, kcache, r, ctx_lens, tables, float(scale), False, *(plan if plan is not None else (None, None))
        )
    if schedule is not None and shared is None:
        schedule.plan = (sched_meta, num_splits)  # ours, or FlashMLA's when it planned
    o = o.view(b, h, r)
    if out is None:
        return o
    out.copy_(o)
    return out


__all__ = [
    "COMBINE_ENV",
    "PAGE_SIZE",
    "TRITON_COMBINE_MAX_BATCH",
    "DecodeSchedule",
    "combine_impl",
    "flashmla_decode_fwd",
    "flashmla_unusable",
    "mla_decode_impl",
    "use_flashmla",
]
