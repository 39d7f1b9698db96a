"""Kernel-check sections: paged attention (GQA, MLA absorbed / expanded, SDPA comparison) and page copy."""

from __future__ import annotations

import torch

from bench.kernels_check.report import BF16, DEV, Report, _pages, _qsl, timed


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
