"""GPU kernel check: every fast kernel vs its naive reference at real shapes, with timings.

    python -m bench.gpu_kernels_check [--quick] [--only attention,moe,...]

Needs CUDA; no network, no model download. Shapes: Kimi-Linear (KDA 32 heads x 128, conv W=4; MLA 32 heads,
kv_lora_rank 512 + rope 64, nope 128, v 128; MoE 256 experts top-8, size 1024, hidden 2304) and a
Qwen3-8B-like GQA (32 q heads, 8 kv heads, head_dim 128); pages of 16 and 64 tokens, contexts around 4k
(page-unaligned). Each line prints the max abs / max rel (to max |ref|) / relative RMS error against the
reference (computed in fp32 from the same bf16 inputs), the kernel time (torch.cuda.Event, mean over
iterations after warm-up; metadata built outside the timed region, as the backend does once per step) and
the achieved bytes/s (memory-bound kernels) or FLOP/s (compute-bound ones). A section that fails (or needs
fla-core when it is not importable) prints why and the script goes on. Exit code 1 if any check failed.

Sections: attention (GQA, MLA absorbed / expanded, SDPA comparison), page_copy, short_conv, state_copy,
moe, kda (fla-core chunk_kda incl. chunk-boundary states, fused recurrent decode + spec), backends (GPU
vs reference backends on one mixed ForwardBatch at real shapes) and engine (tiny models: GPU backends vs
TANDEM_BACKEND=torch, greedy tokens). Runs in about 2-4 minutes on an H200, most of it Triton / fla
compilation and autotuning.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

GB = 1e9
TFLOP = 1e12


# ---------------------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Report:
    rows: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def check(
        self,
        name: str,
        ref: torch.Tensor | None,
        out: torch.Tensor | None,
        ms: float | None = None,
        nbytes: float | None = None,
        flops: float | None = None,
        rel_tol: float = 2e-2,
        exact: bool = False,
    ) -> None:
        err = ""
        ok = True
        if ref is not None and out is not None:
            r, o = ref.detach().float(), out.detach().float()
            if r.shape != o.shape:
                ok, err = False, f"shape {tuple(o.shape)} != {tuple(r.shape)}"
            else:
                d = (r - o).abs()
                max_abs = d.max().item() if d.numel() else 0.0
                scale = r.abs().max().item() if r.numel() else 0.0
                rms = (d.pow(2).sum().sqrt() / r.pow(2).sum().sqrt().clamp_min(1e-30)).item() if r.numel() else 0.0
                nan = bool(torch.isnan(o).any())
                ok = not nan and ((max_abs == 0.0) if exact else (rms < rel_tol))
                err = f"max_abs {max_abs:9.2e}  max_rel {max_abs / max(scale, 1e-30):9.2e}  rel_rms {rms:9.2e}"
                err += "  NaN!" if nan else ""
        perf = ""
        if ms is not None:
            perf = f"{ms * 1e3:9.1f} us"
            if nbytes:
                perf += f"  {nbytes / (ms * 1e-3) / GB:8.1f} GB/s"
            if flops:
                perf += f"  {flops / (ms * 1e-3) / TFLOP:8.1f} TFLOP/s"
        line = f"  {'ok ' if ok else 'BAD'} {name:<58} {err:<62} {perf}"
        print(line, flush=True)
        self.rows.append(line)
        if not ok:
            self.failures.append(name)

    def note(self, text: str) -> None:
        print(f"      {text}", flush=True)


def timed(fn: Callable[[], object], warmup: int = 2, iters: int = 10) -> float:
    """Mean milliseconds per call (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kernel_ms(fn: Callable[[], object], iters: int = 20) -> float:
    """Milliseconds of GPU kernel time per call (torch.profiler): for kernels of a few microseconds, where
    back-to-back calls time the host's launches instead."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    us = sum(e.device_time_total for e in prof.events() if e.device_type == DeviceType.CUDA)
    return us / 1e3 / iters


def first_call(fn: Callable[[], object]) -> tuple[object, float]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


DEV = torch.device("cuda")
BF16 = torch.bfloat16


def _pages(ctx_lens: list[int], page_size: int, extra: int = 4, seed: int = 0):
    """Shuffled page ids per sequence and the pool size."""
    n_pages = [-(-c // page_size) for c in ctx_lens]
    total = sum(n_pages) + extra
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    tables, used = [], 0
    for n in n_pages:
        tables.append(perm[used : used + n].to(DEV))
        used += n
    return tables, total


def _qsl(q_lens: list[int]) -> list[int]:
    out = [0]
    for q in q_lens:
        out.append(out[-1] + q)
    return out


# ---------------------------------------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------------------------------------


def section_attention(rep: Report, quick: bool) -> None:
    from kernels.paged_attention.meta import attention_flops, pack_block_tables, plan_gqa
    from kernels.paged_attention.mla import plan_mla, run_mla
    from kernels.paged_attention.naive import paged_gqa_attention, paged_mla_attention
    from kernels.paged_attention.triton import attention_fwd

    # ---- GQA: Qwen3-8B-like ----
    hq, hkv, d = 32, 8, 128
    cases = [
        ("decode  N=64 ctx~4k", [1] * 64, [4096 - 7 * (i % 5) for i in range(64)]),
        ("decode  N=8 ctx 4093 (split-KV)", [1] * 8, [4093] * 8),
        ("spec    N=32 q=4 ctx~4k", [4] * 32, [4000 + 3 * i for i in range(32)]),
        ("prefill 4 x 1021, no prefix", [1021] * 4, [1021] * 4),
        ("chunk   q=2048 over prefix 2045", [2048], [4093]),
        ("mixed   32 decode + 1 chunk 1000/3000", [1] * 32 + [1000], [3001] * 32 + [3000]),
    ]
    if quick:
        cases = cases[:1] + cases[3:5]
    # every case at page 16 (vLLM's default for GQA), the decode case again at page 64
    for page_size, label, q_lens, ctx in [(16, *c) for c in cases] + [(64, *cases[0])]:
        tables, num_pages = _pages(ctx, page_size)
        kv = torch.randn(num_pages, page_size, 2, hkv, d, device=DEV, dtype=BF16)
        qsl = _qsl(q_lens)
        q = torch.randn(qsl[-1], hq, d, device=DEV, dtype=BF16)
        meta = plan_gqa(qsl, ctx, pack_block_tables(tables, DEV), hq // hkv, DEV, d)
        fn = lambda: attention_fwd(q, kv[:, :, 0], kv[:, :, 1], meta, d**-0.5)  # noqa: B023
        out = fn()
        ref = paged_gqa_attention(q.float(), kv.float(), qsl, ctx, tables, d**-0.5)
        ms = timed(fn)
        kv_bytes = sum(ctx) * 2 * hkv * d * 2
        rep.check(
            f"gqa p{page_size} {label}",
            ref,
            out,
            ms,
            nbytes=kv_bytes + 2 * q.numel() * 2,
            flops=attention_flops(q_lens, ctx, hq, d, d),
        )
    # SDPA comparison for the no-prefix prefill (the case SDPA could serve; see kernels/paged_attention/README.md)
    q_lens = [1021] * 4
    tables, num_pages = _pages(q_lens, 16)
    kv = torch.randn(num_pages, 16, 2, hkv, d, device=DEV, dtype=BF16)
    qsl = _qsl(q_lens)
    q = torch.randn(qsl[-1], hq, d, device=DEV, dtype=BF16)
    rows = [
        (t[:, None] * 16 + torch.arange(16, device=DEV)).reshape(-1)[:n] for t, n in zip(tables, q_lens, strict=True)
    ]
    flat = kv.view(-1, 2, hkv, d)

    def sdpa():
        outs = []
        for i, r in enumerate(rows):  # per sequence: gather K/V, then flash SDPA (GQA via enable_gqa)
            k, v = flat[r, 0].transpose(0, 1), flat[r, 1].transpose(0, 1)
            qi = q[qsl[i] : qsl[i + 1]].transpose(0, 1)
            o = torch.nn.functional.scaled_dot_product_attention(qi, k, v, is_causal=True, enable_gqa=True)
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)

    meta = plan_gqa(qsl, q_lens, pack_block_tables(tables, DEV), hq // hkv, DEV, d)
    ref = attention_fwd(q, kv[:, :, 0], kv[:, :, 1], meta, d**-0.5)
    rep.check(
        "gqa p16 prefill 4 x 1021: torch SDPA (gather + flash, per seq)",
        ref,
        sdpa(),
        timed(sdpa),
        flops=attention_flops(q_lens, q_lens, hq, d, d),
    )

    # ---- MLA: Kimi-Linear ----
    h, rank, rope, nope, vd = 32, 512, 64, 128, 128
    scale = (nope + rope) ** -0.5
    kv_b = (torch.randn(h * (nope + vd), rank, device=DEV) * rank**-0.5).to(BF16)
    mla_cases = [
        ("decode  N=64 ctx~4k", [1] * 64, [4096 - 5 * (i % 7) for i in range(64)], None),
        ("decode  N=4 ctx 4095 (split-KV)", [1] * 4, [4095] * 4, None),
        ("decode  N=16 ctx~32k (split-KV)", [1] * 16, [32768 - 3 * i for i in range(16)], None),
        ("spec    N=32 q=4 ctx~4k", [4] * 32, [4000 + i for i in range(32)], None),
        ("chunk   q=1024/4090 absorbed", [1024], [4090], None),
        ("chunk   q=1024/4090 expanded", [1024], [4090], 0),
        ("prefill 2 x 2043 expanded", [2043] * 2, [2043] * 2, 0),
        ("mixed   32 decode + chunk 1000/3000 (auto)", [1] * 32 + [1000], [3001] * 32 + [3000], 192),
    ]
    if quick:
        mla_cases = mla_cases[:1] + mla_cases[4:6]
    # every case at page 64, the decode case again at page 16
    for page_size, label, q_lens, ctx, thr in [(64, *c) for c in mla_cases] + [(16, *mla_cases[0])]:
        tables, num_pages = _pages(ctx, page_size)
        lat = torch.randn(num_pages, page_size, rank + rope, device=DEV, dtype=BF16)
        qsl = _qsl(q_lens)
        q = torch.randn(qsl[-1], h, nope + rope, device=DEV, dtype=BF16)
        parts = plan_mla(qsl, ctx, pack_block_tables(tables, DEV), h, page_size, rank, DEV, thr)
        fn = lambda: run_mla(q, lat, parts, kv_b, rank, nope, vd, scale)  # noqa: B023
        out = fn()
        ref = paged_mla_attention(q.float(), lat.float(), qsl, ctx, tables, kv_b.float(), rank, nope, vd, scale)
        ms = timed(fn)
        flops = 0.0  # per sequence: run_mla absorbs below the threshold and expands the latent above it
        for ql, c in zip(q_lens, ctx, strict=True):
            if thr is None or ql < thr:
                flops += attention_flops([ql], [c], h, rank + rope, rank)
            else:
                flops += attention_flops([ql], [c], h, nope + rope, vd) + 2.0 * c * rank * h * (nope + vd)
        rep.check(
            f"mla p{page_size} {label}",
            ref,
            out,
            ms,
            nbytes=sum(ctx) * (rank + rope) * 2,
            flops=flops,
        )


def section_page_copy(rep: Report, quick: bool) -> None:
    from kernels.page_copy.naive import naive_pack_pages, naive_unpack_pages
    from kernels.page_copy.triton import pack_pages, unpack_pages

    for label, layers, entry, page_size, start, n in [
        ("MLA 7 layers, 4093 tok, p64", 7, (576,), 64, 0, 4093),
        ("MLA 7 layers, tokens 1000..3037, p16", 7, (576,), 16, 1000, 2037),
        ("GQA 36 layers K|V 8x128, 4093 tok, p16", 36, (2, 8, 128), 16, 0, 4093),
    ]:
        tables, num_pages = _pages([start + n], page_size, extra=8)
        caches = [torch.randn(num_pages, page_size, *entry, device=DEV, dtype=BF16) for _ in range(layers)]
        table = tables[0]
        out = pack_pages(caches, table, start, n)
        ref = naive_pack_pages(caches, table, start, n)
        ms = timed(lambda: pack_pages(caches, table, start, n, out=out))  # noqa: B023
        rep.check(f"pack   {label}", ref, out, ms, nbytes=2 * out.numel() * 2, exact=True)
        new = torch.randn_like(out)
        mine, theirs = [c.clone() for c in caches], [c.clone() for c in caches]
        unpack_pages(mine, table, start, new)
        naive_unpack_pages(theirs, table, start, new)
        ms = timed(lambda: unpack_pages(mine, table, start, new))  # noqa: B023
        rep.check(f"unpack {label}", torch.stack(theirs), torch.stack(mine), ms, nbytes=2 * new.numel() * 2, exact=True)


def section_short_conv(rep: Report, quick: bool) -> None:
    from kernels.short_conv.naive import naive_short_conv
    from kernels.short_conv.naive_spec import naive_short_conv_update
    from kernels.short_conv.triton import short_conv_update

    c, w = 3 * 32 * 128, 4
    weight = torch.randn(c, w, device=DEV, dtype=BF16)
    for label, lens, init in [
        ("decode N=256", [1] * 256, [True] * 256),
        ("prefill 1 x 4093 (first chunk)", [4093], [False]),
        ("mixed 64 decode + 2 x 997", [1] * 64 + [997, 997], [True] * 65 + [False]),
    ]:
        n = len(lens)
        qsl = _qsl(lens)
        x = torch.randn(qsl[-1], c, device=DEV, dtype=BF16)
        state = torch.randn(n + 3, c, w - 1, device=DEV, dtype=BF16)
        slots = list(range(2, n + 2))
        ref_state, ref = state.clone(), torch.empty_like(x)
        for i, s in enumerate(slots):
            y, win = naive_short_conv(x[qsl[i] : qsl[i + 1]], weight, ref_state[s] if init[i] else None)
            ref[qsl[i] : qsl[i + 1]], ref_state[s] = y, win
        st = state.clone()
        out = short_conv_update(x, weight, st, slots, qsl, init)
        rep.check(f"short_conv {label}: y", ref, out)
        rep.check(f"short_conv {label}: window", ref_state, st, exact=True)
        slots_t, qsl_t = torch.tensor(slots, device=DEV), torch.tensor(qsl, device=DEV)
        init_t = torch.tensor(init, device=DEV, dtype=torch.int32)
        ms = timed(lambda: short_conv_update(x, weight, st, slots_t, qsl_t, init_t, max_q_len=max(lens)))  # noqa: B023
        rep.check(f"short_conv {label}: time", None, None, ms, nbytes=2 * x.numel() * 2 + 2 * n * c * (w - 1) * 2)
        if max(lens) >= 256:  # the prefill path through fla's causal_conv1d (kernels/short_conv/fla_adapter.py)
            from kernels.short_conv.fla_adapter import conv_step, short_conv_prefill_fla

            st = state.clone()
            step = conv_step(slots, qsl, init, DEV)
            out = short_conv_prefill_fla(x, weight, st, step)
            rep.check(f"short_conv {label}: fla y", ref, out)
            rep.check(f"short_conv {label}: fla window", ref_state, st, exact=True)
            ms = timed(lambda: short_conv_prefill_fla(x, weight, st, step))  # noqa: B023
            rep.check(
                f"short_conv {label}: fla time", None, None, ms, nbytes=2 * x.numel() * 2 + 2 * n * c * (w - 1) * 2
            )
    # spec verify: 64 requests x (1 + 3 drafts), state width W-1+3
    num_spec, n = 3, 64
    lens = [num_spec + 1] * n
    qsl = _qsl(lens)
    x = torch.randn(qsl[-1], c, device=DEV, dtype=BF16)
    state = torch.randn(n, c, w - 1 + num_spec, device=DEV, dtype=BF16)
    acc = [1 + i % (num_spec + 1) for i in range(n)]
    ref_state, ref = state.clone(), torch.empty_like(x)
    for i in range(n):
        y, new = naive_short_conv_update(x[qsl[i] : qsl[i + 1]], weight, ref_state[i], acc[i], spec=True)
        ref[qsl[i] : qsl[i + 1]], ref_state[i] = y, new
    st = state.clone()
    out = short_conv_update(x, weight, st, list(range(n)), qsl, num_accepted=acc, spec=True)
    rep.check("short_conv spec N=64 x 4 tokens: state", ref_state, st, exact=True)
    ms = timed(lambda: short_conv_update(x, weight, st, list(range(n)), qsl, num_accepted=acc, spec=True))
    rep.check("short_conv spec N=64 x 4 tokens: y", ref, out, ms, nbytes=2 * x.numel() * 2)


def section_norms(rep: Report, quick: bool) -> None:
    """fla's fused norms and KDA gate (engine/backends/norm.py, GPUKDABackend.gate) vs the references."""
    from engine.backends.gpu import GPUKDABackend
    from engine.backends.norm import FlaNormBackend, TorchNormBackend
    from kernels.activation import silu_mul
    from kernels.kda.naive import kda_gate

    ref, fla = TorchNormBackend(), FlaNormBackend()
    for t in (64, 8192):
        for dt in (BF16, torch.float32):
            x = torch.randn(t, 2304, device=DEV, dtype=dt)
            r = torch.randn(t, 2304, device=DEV, dtype=dt)
            w = (1 + 0.1 * torch.randn(2304, device=DEV)).to(dt)
            name = f"T={t} {str(dt)[6:]}"
            ms = timed(lambda: fla.rms_norm(x, w, 1e-6))  # noqa: B023
            rep.check(
                f"rms_norm {name}",
                ref.rms_norm(x, w, 1e-6),
                fla.rms_norm(x, w, 1e-6),
                ms,
                2 * x.numel() * x.element_size(),
            )
            y_ref, h_ref = ref.add_rms_norm(x, r, w, 1e-6)
            y, h = fla.add_rms_norm(x, r, w, 1e-6)
            rep.check(f"add_rms_norm {name}: sum", h_ref, h, exact=dt == torch.float32)
            rep.check(f"add_rms_norm {name}: norm", y_ref, y)
            o = torch.randn(t, 32, 128, device=DEV, dtype=dt)
            gate = torch.randn(t, 32, 128, device=DEV, dtype=dt)
            wg = (1 + 0.1 * torch.randn(128, device=DEV)).to(dt)
            rep.check(
                f"gated_rms_norm {name}", ref.gated_rms_norm(o, gate, wg, 1e-6), fla.gated_rms_norm(o, gate, wg, 1e-6)
            )
            g_raw = torch.randn(t, 32 * 128, device=DEV, dtype=dt) * 4
            a_log = torch.randn(1, 1, 32, 1, device=DEV)
            dt_bias = torch.randn(32 * 128, device=DEV)
            want = kda_gate(g_raw, a_log, dt_bias, 128)
            rep.check(f"kda_gate {name}", want, GPUKDABackend().gate(g_raw, a_log, dt_bias, 128), rel_tol=1e-3)
            # SwiGLU on the two strided halves of a packed gate|up output (kernels/activation.py): fla's one
            # kernel vs torch's silu + multiply, at the routed experts' T*k rows for a T-token step
            h13 = torch.randn(t * 8, 2 * 1024, device=DEV, dtype=dt)
            g_half, u_half = h13[:, :1024], h13[:, 1024:]
            want = (torch.nn.functional.silu(g_half.float()) * u_half.float()).to(dt)
            nbytes = 3 * g_half.numel() * g_half.element_size()
            ms = timed(lambda: silu_mul(g_half, u_half))  # noqa: B023
            rep.check(f"silu_mul {name} x8 rows: fla swiglu", want, silu_mul(g_half, u_half), ms, nbytes)
            ms = timed(lambda: torch.nn.functional.silu(g_half) * u_half)  # noqa: B023
            rep.check(f"silu_mul {name} x8 rows: torch", None, None, ms, nbytes)


def section_state_copy(rep: Report, quick: bool) -> None:
    from kernels.state_copy.naive import naive_copy_state_slots
    from kernels.state_copy.triton import copy_state_slots

    layers, slots, h, k = 20, 24, 32, 128
    rec = [torch.randn(slots, h, k, k, device=DEV) for _ in range(layers)]
    conv = [torch.randn(slots, 3 * h * k, 3, device=DEV, dtype=BF16) for _ in range(layers)]
    src, dst, shift = [0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 7], [0, 1, 2, 0, 0, 1, 2, 1]
    ref_rec, ref_conv = [x.clone() for x in rec], [x.clone() for x in conv]
    naive_copy_state_slots(ref_rec, ref_conv, src, dst, shift)
    copy_state_slots(rec, conv, src, dst, shift)
    rep.check("state_copy 20 layers x 8 pairs: recurrent", torch.stack(ref_rec), torch.stack(rec), exact=True)
    rep.check("state_copy 20 layers x 8 pairs: conv (shifted)", torch.stack(ref_conv), torch.stack(conv), exact=True)
    ms = timed(lambda: copy_state_slots(rec, conv, src[:7], dst[:7]))
    nbytes = 2 * 7 * layers * (h * k * k * 4 + 3 * h * k * 3 * 2)
    rep.check("state_copy 20 layers x 7 pairs: time (recurrent + conv)", None, None, ms, nbytes=nbytes)
    ms = timed(lambda: [x[dst[:7]].copy_(x[src[:7]]) for x in rec + conv])
    rep.check("state_copy same with torch indexing (per layer)", None, None, ms, nbytes=nbytes)


def section_moe(rep: Report, quick: bool) -> None:
    from kernels.moe.align import MAX_PAIRS, moe_align_auto, moe_align_triton
    from kernels.moe.combine import moe_combine_triton
    from kernels.moe.decode import MAX_PAIRS as DECODE_MAX_PAIRS
    from kernels.moe.decode import moe_experts_decode
    from kernels.moe.grouped import grouped_mm_supported, grouped_moe, moe_align, moe_combine
    from kernels.moe.naive import naive_moe, sigmoid_topk_route
    from kernels.moe.triton import sigmoid_topk_route_triton

    e, k, hid, inter = 256, 8, 2304, 1024
    gate = torch.randn(e, hid, device=DEV) * hid**-0.5
    bias = torch.randn(e, device=DEV) * 0.05
    for t in (64, 4096):
        x = torch.randn(t, hid, device=DEV, dtype=BF16)
        logits = torch.nn.functional.linear(x.float(), gate)
        w_ref, ids_ref = sigmoid_topk_route(logits, bias, k, True, 2.446)
        w, ids = sigmoid_topk_route_triton(logits, bias, k, True, 2.446)
        same = torch.equal(ids.sort(1)[0], ids_ref.sort(1)[0])
        rep.check(f"route T={t} E=256 k=8: ids", ids_ref.sort(1)[0], ids.sort(1)[0], exact=True)
        if same:
            rep.check(
                f"route T={t}: weights", w_ref.gather(1, ids_ref.sort(1)[1]), w.gather(1, ids.sort(1)[1]), rel_tol=1e-5
            )
        ms_t = timed(lambda: sigmoid_topk_route_triton(logits, bias, k, True, 2.446))  # noqa: B023
        ms_n = timed(lambda: sigmoid_topk_route(logits, bias, k, True, 2.446))  # noqa: B023
        rep.check(f"route T={t}: Triton kernel", None, None, ms_t, nbytes=logits.numel() * 4)
        rep.check(f"route T={t}: torch (naive, 7 kernels)", None, None, ms_n, nbytes=logits.numel() * 4)
        for bt in (1, 2, 4, 8, 16):  # tokens per program, GPU time only
            ms_k = kernel_ms(lambda: sigmoid_topk_route_triton(logits, bias, k, True, 2.446, block_t=bt))  # noqa: B023
            rep.check(f"route T={t}: kernel time, {bt} tokens per program", None, None, ms_k)
    w1 = (torch.randn(e, inter, hid, device=DEV) * hid**-0.5).to(BF16)
    w3 = (torch.randn(e, inter, hid, device=DEV) * hid**-0.5).to(BF16)
    w2 = (torch.randn(e, hid, inter, device=DEV) * inter**-0.5).to(BF16)
    w1f, w3f, w2f = w1.float(), w3.float(), w2.float()  # the fp32 reference's weights (7 GB)
    rep.note(f"grouped_mm supported here: {grouped_mm_supported(w1)}")
    for t in (1, 64, 4096) if not quick else (64,):
        x = torch.randn(t, hid, device=DEV, dtype=BF16)
        logits = torch.nn.functional.linear(x.float(), gate)
        weights, ids = sigmoid_topk_route(logits, bias, k, True, 2.446)
        m = min(t, 64)  # tokens are independent: check the first 64 against the fp32 reference
        ref = naive_moe(x[:m].float(), weights[:m], ids[:m], w1f, w3f, w2f)
        flops = 2.0 * t * k * 3 * hid * inter
        active = torch.unique(ids).numel()
        nbytes = active * 3 * hid * inter * 2
        for impl in ("grouped_mm", "loop") if grouped_mm_supported(x) else ("loop",):
            out = grouped_moe(x, weights, ids, w1, w3, w2, impl=impl)
            ms = timed(lambda: grouped_moe(x, weights, ids, w1, w3, w2, impl=impl), iters=5)  # noqa: B023
            rep.check(f"experts T={t} ({active} experts hit) {impl}", ref, out[: ref.shape[0]], ms, nbytes, flops)
        ms = timed(lambda: naive_moe(x, weights, ids, w1, w3, w2), iters=3)  # noqa: B023
        rep.check(f"experts T={t}: naive per-expert loop (bf16)", None, None, ms, nbytes, flops)
        if grouped_mm_supported(x):  # gate | up as one grouped GEMM (SparseMoE.pack_weights)
            w13 = torch.cat([w1, w3], dim=1)
            kw = dict(w13=w13, align=moe_align_auto)
            out = grouped_moe(x, weights, ids, w1, w3, w2, **kw)
            ms = timed(lambda: grouped_moe(x, weights, ids, w1, w3, w2, **kw), iters=5)  # noqa: B023
            rep.check(f"experts T={t}: packed w13, one-launch align", ref, out[: ref.shape[0]], ms, nbytes, flops)
            kw["combine"] = moe_combine_triton  # as GPUMoEBackend runs it
            out = grouped_moe(x, weights, ids, w1, w3, w2, **kw)
            ms = timed(lambda: grouped_moe(x, weights, ids, w1, w3, w2, **kw), iters=5)  # noqa: B023
            rep.check(f"experts T={t}: + one-launch combine", ref, out[: ref.shape[0]], ms, nbytes, flops)
            if t * k <= DECODE_MAX_PAIRS:  # align + the two decode launches + combine, a few tile shapes

                def decode_path(bm: int, bn: int, bk: int, nw: int) -> torch.Tensor:
                    al = moe_align_triton(ids, e)  # noqa: B023
                    y = moe_experts_decode(x, al, w13, w2, bm, bn, bk, nw)  # noqa: B023
                    return moe_combine_triton(y, al.rows_of_pairs(), weights, BF16)  # noqa: B023

                for cfg in ((16, 64, 128, 4), (16, 32, 128, 4), (16, 128, 64, 4), (16, 64, 256, 8), (32, 64, 128, 4)):
                    out = decode_path(*cfg)
                    ms = timed(lambda: decode_path(*cfg), iters=5)  # noqa: B023
                    name = f"experts T={t}: decode kernels (kernels/moe/decode.py) m/n/k/warps {cfg}"
                    rep.check(name, ref, out[: ref.shape[0]], ms, nbytes, flops)
            del w13
        y = torch.randn(t * k, hid, device=DEV, dtype=BF16)  # the combine alone, against torch's gather + sum
        rows = torch.randperm(t * k, device=DEV)
        want = moe_combine(y, rows, weights, BF16)
        ms = timed(lambda: moe_combine_triton(y, rows, weights, BF16))  # noqa: B023
        rep.check(f"combine T={t}: one launch", want, moe_combine_triton(y, rows, weights, BF16), ms, y.numel() * 2)
        ms = timed(lambda: moe_combine(y, rows, weights, BF16))  # noqa: B023
        rep.check(f"combine T={t}: torch", None, None, ms, y.numel() * 2)
        if t * k <= MAX_PAIRS:
            al_ref, al = moe_align(ids, e), moe_align_triton(ids, e)
            rep.check(f"align T={t}: order", al_ref.order, al.order, exact=True)
            rep.check(f"align T={t}: ends", al_ref.offsets, al.offsets, exact=True)
            rep.check(f"align T={t}: torch sort path", None, None, timed(lambda: moe_align(ids, e)))  # noqa: B023
            rep.check(f"align T={t}: one launch", None, None, timed(lambda: moe_align_triton(ids, e)))  # noqa: B023
            for warps in (1, 4, 8):  # one program per expert; the one-program kernel took 27.9 / 2.4 us (T=64 / 1)
                fn = lambda: moe_align_triton(ids, e, num_warps=warps)  # noqa: B023
                same = torch.equal(fn().order, al_ref.order) and fn().offsets.tolist() == al_ref.offsets.tolist()
                rep.check(f"align T={t}: kernel time, {warps} warps, same {same}", None, None, kernel_ms(fn))
        torch.cuda.empty_cache()


def section_kda(rep: Report, quick: bool) -> None:
    from kernels.kda.fla_adapter import chunk_kda_varlen, fla_available, fused_recurrent_kda_slots
    from kernels.kda.naive import kda_gate, naive_chunk_kda, naive_recurrent_kda

    if not fla_available():
        rep.note("fla-core is not importable: KDA section skipped (pip install fla-core==0.6.0 einops packaging)")
        return
    h, kd = 32, 128

    def inputs(t, seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        q, k, v = (torch.randn(t, h, kd, device=DEV, generator=g).to(BF16) for _ in range(3))
        a_log = torch.log(torch.empty(h, device=DEV).uniform_(1, 16, generator=g))
        dt_bias = torch.randn(h * kd, device=DEV, generator=g) * 0.5
        gate = kda_gate(torch.randn(t, h * kd, device=DEV, generator=g), a_log, dt_bias, kd)
        beta = torch.rand(t, h, device=DEV, generator=g).to(BF16)
        return q, k, v, gate, beta

    # prefill: chunk_kda varlen
    for label, lens in [("1 x 4093", [4093]), ("4 x 1021 + 1 x 64", [1021] * 4 + [64])]:
        cu = _qsl(lens)
        q, k, v, g, beta = inputs(cu[-1], 0)
        init = torch.randn(len(lens), h, kd, kd, device=DEV) * 0.05
        (o, final, states), t_first = first_call(
            lambda: chunk_kda_varlen(q, k, v, g, beta, init, cu, return_intermediate_states=True)  # noqa: B023
        )
        rep.note(f"chunk_kda {label}: first call {t_first:.1f} s (compile + autotune)")
        ref_o, ref_s, ref_h = [], [], []
        for i in range(len(lens)):
            sl = slice(cu[i], cu[i + 1])
            args = [x[None, sl].float() for x in (q, k, v, g, beta)]
            oo, ss = naive_chunk_kda(*args, init[i : i + 1])
            ref_o.append(oo[0])
            ref_s.append(ss[0])
            for c in range(-(-lens[i] // 64)):  # chunk-boundary states: after 64*c tokens
                if c == 0:
                    ref_h.append(init[i])
                elif c in (1, -(-lens[i] // 64) - 1):  # spot-check the first and the last boundary
                    _, hs = naive_chunk_kda(*(a[:, : 64 * c] for a in args), init[i : i + 1])
                    ref_h.append(hs[0])
                else:
                    ref_h.append(None)
        ms = timed(lambda: chunk_kda_varlen(q, k, v, g, beta, init, cu))  # noqa: B023
        flops = 2.0 * cu[-1] * h * (4 * kd * kd + 2 * 64 * kd)  # rough: state update/readout + intra-chunk
        rep.check(f"chunk_kda {label}: o", torch.cat(ref_o), o, ms, flops=flops, rel_tol=3e-2)
        rep.check(f"chunk_kda {label}: final state", torch.stack(ref_s), final, rel_tol=3e-2)
        idx = [j for j, r in enumerate(ref_h) if r is not None]
        rep.check(
            f"chunk_kda {label}: chunk-boundary states ({len(idx)} checked)",
            torch.stack([ref_h[j] for j in idx]),
            states[idx].float(),
            rel_tol=3e-2,
        )
    # decode: 1-D slots, in place
    n, slots = 256, 300
    q, k, v, g, beta = inputs(n, 1)
    pool = torch.randn(slots, h, kd, kd, device=DEV) * 0.05
    sl = torch.randperm(slots, device=DEV)[:n]
    ref_o, ref_s = naive_recurrent_kda(*(x[:, None] for x in (q, k, v, g, beta)), pool[sl])
    p2 = pool.clone()
    o = fused_recurrent_kda_slots(q, k, v, g, beta, p2, sl)
    rep.check("fused_recurrent decode N=256: o", ref_o[:, 0], o)
    rep.check("fused_recurrent decode N=256: state", ref_s, p2[sl])
    ms = timed(lambda: fused_recurrent_kda_slots(q, k, v, g, beta, p2, sl))
    rep.check("fused_recurrent decode N=256: time", None, None, ms, nbytes=2 * n * h * kd * kd * 4)
    # spec verify: 2-D slots, num_accepted
    n, width = 64, 4
    q, k, v, g, beta = inputs(n * width, 2)
    idx = torch.randperm(slots, device=DEV)[: n * width].view(n, width)
    acc = torch.randint(1, width + 1, (n,), device=DEV)
    ref_pool, ref_o = pool.clone(), torch.empty(n * width, h, kd, device=DEV)
    for i in range(n):
        s = ref_pool[idx[i, acc[i] - 1]][None]
        for t in range(width):
            r = slice(i * width + t, i * width + t + 1)
            oo, s = naive_recurrent_kda(*(x[None, r] for x in (q, k, v, g, beta)), s)
            ref_o[r] = oo[0]
            ref_pool[idx[i, t]] = s[0]
    p2 = pool.clone()
    o = fused_recurrent_kda_slots(q, k, v, g, beta, p2, idx, acc)
    rep.check("fused_recurrent spec N=64 x 4: o", ref_o, o)
    rep.check("fused_recurrent spec N=64 x 4: per-token states", ref_pool, p2)


def section_backends(rep: Report, quick: bool) -> None:
    """GPU vs reference backends on one mixed ForwardBatch at real shapes (glue: metadata, splits, merges)."""
    from engine.backends.base import MLADims
    from engine.backends.gpu import GPUAttentionBackend, GPUMoEBackend, gpu_kda_backend
    from engine.backends.torch_ref import TorchAttentionBackend, TorchKDABackend, TorchMoEBackend
    from engine.forward_batch import ForwardBatch
    from kernels.kda.naive import kda_gate

    page_size = 64
    q_lens = [1] * 16 + [700, 300, 1]
    ctx = [2000 + 37 * i for i in range(16)] + [700, 2100, 128]
    tables, num_pages = _pages(ctx, page_size, extra=8)
    qsl = _qsl(q_lens)
    slot_mapping = []
    for i, (ql, c) in enumerate(zip(q_lens, ctx, strict=True)):
        tl_ = tables[i].tolist()
        slot_mapping += [tl_[p // page_size] * page_size + p % page_size for p in range(c - ql, c)]
    n = len(q_lens)
    batch = ForwardBatch(
        input_ids=torch.zeros(qsl[-1], dtype=torch.int64, device=DEV),
        positions=torch.cat([torch.arange(c - ql, c) for ql, c in zip(q_lens, ctx, strict=True)]).to(DEV),
        query_start_loc=qsl,
        context_lens=ctx,
        block_tables=tables,
        slot_mapping=torch.tensor(slot_mapping, device=DEV),
        state_slots=[2 * i for i in range(n)],
        has_initial_state=[c > ql for ql, c in zip(q_lens, ctx, strict=True)],
        logits_indices=torch.tensor(qsl[1:], device=DEV) - 1,
        checkpoints=[()] * 16 + [((64, 50), (640, 51)), ((1856, 52), (2048, 53)), ((128, 54),)],
    )
    t = batch.num_tokens
    gpu_att, ref_att = GPUAttentionBackend(), TorchAttentionBackend()
    # MLA
    dims = MLADims(512, 128, 64, 128)
    lat = torch.randn(num_pages, page_size, 576, device=DEV, dtype=BF16)
    kv_b = (torch.randn(32 * 256, 512, device=DEV) * 512**-0.5).to(BF16)
    q = torch.randn(t, 32, 192, device=DEV, dtype=BF16)
    scale = 192**-0.5
    out = gpu_att.mla(q, lat, batch, kv_b, dims, scale)
    ref = ref_att.mla(q.float(), lat.float(), batch, kv_b.float(), dims, scale)
    ms = timed(lambda: gpu_att.mla(q, lat, batch, kv_b, dims, scale))
    rep.check("backend mla (16 decode + 2 chunks + 1 first chunk)", ref, out, ms)
    # GQA
    kv = torch.randn(num_pages, page_size, 2, 8, 128, device=DEV, dtype=BF16)
    qg = torch.randn(t, 32, 128, device=DEV, dtype=BF16)
    out = gpu_att.gqa(qg, kv, batch, 128**-0.5)
    ref = ref_att.gqa(qg.float(), kv.float(), batch, 128**-0.5)
    rep.check("backend gqa (same batch)", ref, out, timed(lambda: gpu_att.gqa(qg, kv, batch, 128**-0.5)))
    # KDA with rung checkpoints
    kda = gpu_kda_backend()
    if isinstance(kda, TorchKDABackend):
        rep.note("fla-core not importable: backend KDA check skipped")
    else:
        h, kd, slots = 32, 128, 2 * n + 60
        conv = torch.randn(slots, 3 * h * kd, 3, device=DEV, dtype=BF16)
        rec = torch.randn(slots, h, kd, kd, device=DEV) * 0.05
        weight = torch.randn(3 * h * kd, 4, device=DEV, dtype=BF16)
        x = torch.randn(t, 3 * h * kd, device=DEV, dtype=BF16)
        conv_ref, rec_ref = conv.clone(), rec.clone()
        y = kda.short_conv(x, conv, weight, batch)
        y_ref = TorchKDABackend().short_conv(x, conv_ref, weight, batch)
        rep.check("backend short_conv (+ rung windows)", y_ref, y)
        rep.check("backend short_conv windows", conv_ref, conv, exact=True)
        q, k, v = (torch.randn(t, h, kd, device=DEV, dtype=BF16) for _ in range(3))
        g = kda_gate(
            torch.randn(t, h * kd, device=DEV), torch.zeros(h, device=DEV), torch.zeros(h * kd, device=DEV), kd
        )
        beta = torch.rand(t, h, device=DEV, dtype=BF16)
        o = kda.recurrence(q, k, v, g, beta, rec, batch)
        o_ref = TorchKDABackend().recurrence(*(a.float() for a in (q, k, v, g, beta)), rec_ref, batch)
        rep.check("backend kda recurrence o", o_ref, o, rel_tol=3e-2)
        rep.check("backend kda states (running + rung checkpoints)", rec_ref, rec, rel_tol=3e-2)
    # MoE
    e = 256
    logits = torch.randn(t, e, device=DEV)
    _, ids_ref = TorchMoEBackend().route(logits, None, 8, True, 2.446)
    _, ids = GPUMoEBackend().route(logits, None, 8, True, 2.446)
    rep.check("backend route ids", ids_ref.sort(1)[0], ids.sort(1)[0], exact=True)


def section_engine(rep: Report, quick: bool) -> None:
    """Tiny models on CUDA (fp32): GPU backends vs TANDEM_BACKEND=torch, greedy tokens through the engine."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.tiny_model import make_tiny_model

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (5, 70, 130, 257)]
    prompts.append(prompts[2][:128] + prompts[0])
    with tempfile.TemporaryDirectory() as root:
        for arch, cachings in (("kimi_linear", (False, True)), ("qwen3", (False,))):
            model_dir = make_tiny_model(os.path.join(root, arch), arch=arch, seed=0)
            for caching in cachings:
                outs = {}
                for backend in ("torch", "auto"):
                    os.environ["TANDEM_BACKEND"] = backend
                    cfg = EngineConfig(
                        model=str(model_dir),
                        device="cuda",
                        dtype="float32",
                        max_num_batched_tokens=96,
                        kv_cache_memory_bytes=64 << 20,
                        enable_prefix_caching=caching,
                    )
                    eng = LLMEngine(cfg)
                    outs[backend] = [o.output_token_ids for o in eng.generate(prompts, params)]
                    kinds = [type(b).__name__ for b in vars(eng.model.backends).values()]
                    del eng
                os.environ.pop("TANDEM_BACKEND", None)
                same = sum(a == b for a, b in zip(outs["torch"], outs["auto"], strict=True))
                line = f"engine {arch} prefix_cache={caching}: {same}/{len(prompts)} requests token-identical ({kinds})"
                ref_t = torch.tensor([t for toks in outs["torch"] for t in toks])
                got_t = torch.tensor([t for toks in outs["auto"] for t in toks])
                rep.check(line, ref_t, got_t, exact=True)
    rep.note("fp32 on CUDA: fla's chunk kernels use TF32 dots, so a rare greedy flip on the random tiny models is")
    rep.note("possible; a mismatch here means: rerun with TANDEM_BACKEND=torch vs auto and compare logits.")


def section_router(rep: Report, quick: bool) -> None:
    """The MoE router's fp32 logits (engine/models/layers.router_logits): HF's fp32 GEMM (SIMT sgemm) vs one
    bf16 GEMM with fp32 accumulation and output, both against fp64; and how often the top-8 experts differ."""
    import torch.nn.functional as F

    from engine.models.layers import router_logits

    torch.backends.cuda.matmul.allow_tf32 = False
    for t in (1, 64, 8192):
        x = torch.randn(t, 2304, device=DEV).to(BF16)
        w = (torch.randn(256, 2304, device=DEV) * 2304**-0.5).to(BF16)
        w32 = w.float()
        want = F.linear(x.double(), w.double())
        fp32 = F.linear(x.float(), w32)
        ms = timed(lambda: F.linear(x.float(), w32))  # noqa: B023
        rep.check(f"router T={t}: fp32 GEMM vs fp64", want, fp32, ms, rel_tol=1e-6)
        got = router_logits(x, w, w32)
        ms = timed(lambda: router_logits(x, w, w32))  # noqa: B023
        rep.check(f"router T={t}: bf16 GEMM, fp32 out vs fp64", want, got, ms, rel_tol=1e-5)
        same = (fp32.topk(8).indices.sort(1).values == got.topk(8).indices.sort(1).values).all(1).float().mean()
        rep.note(f"T={t}: max |bf16-GEMM - fp32-GEMM| {(got - fp32).abs().max().item():.3g}, top-8 equal {same:.4f}")


SECTIONS = {
    "attention": section_attention,
    "page_copy": section_page_copy,
    "short_conv": section_short_conv,
    "state_copy": section_state_copy,
    "norms": section_norms,
    "moe": section_moe,
    "router": section_router,
    "kda": section_kda,
    "backends": section_backends,
    "engine": section_engine,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help=f"comma-separated sections of {','.join(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_kernels_check: no CUDA device; the CPU checks are `pytest tests/kernels` (TRITON_INTERPRET=1).")
        return 0
    names = [s for s in args.only.split(",") if s] or list(SECTIONS)
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    import triton

    print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    try:
        import fla

        print(f"fla-core {getattr(fla, '__version__', '?')}")
    except Exception as e:  # report and go on
        print(f"fla-core not importable ({type(e).__name__}: {e}); KDA checks will be skipped")
    torch.manual_seed(0)
    rep = Report()
    t_all = time.perf_counter()
    for name in names:
        print(f"\n== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            SECTIONS[name](rep, args.quick)
        except Exception:  # one broken section must not hide the others
            rep.errors.append(name)
            print(
                f"  ERROR in section {name}:\n" + "".join("    " + ln for ln in traceback.format_exc().splitlines(True))
            )
        torch.cuda.empty_cache()
        print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(
        f"\n{len(rep.rows)} lines, {len(rep.failures)} failed checks, {len(rep.errors)} sections with errors, "
        f"{time.perf_counter() - t_all:.0f} s total"
    )
    for f in rep.failures:
        print(f"  FAILED {f}")
    for e in rep.errors:
        print(f"  ERROR  {e}")
    return 1 if rep.failures or rep.errors else 0


if __name__ == "__main__":
    sys.exit(main())
