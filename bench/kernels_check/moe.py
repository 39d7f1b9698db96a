"""Kernel-check sections: MoE routing, experts, align and combine; the router's fp32 logits."""

from __future__ import annotations

import torch

from bench.kernels_check.report import BF16, DEV, Report, kernel_ms, timed


def section_moe(rep: Report, quick: bool) -> None:
    from kernels.moe.align import MAX_PAIRS, moe_align_auto, moe_align_triton
    from kernels.moe.combine import moe_combine_triton
    from kernels.moe.decode import MAX_PAIRS as DECODE_MAX_PAIRS
    from kernels.moe.decode import decode_gemm_tiles, moe_experts_decode
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
                    tiles = decode_gemm_tiles(bm, bn, bk, nw)
                    y = moe_experts_decode(x, al, w13, w2, tiles, tiles)  # noqa: B023
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
