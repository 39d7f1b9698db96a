"""Kernel-check section: KDA (fla-core chunk_kda incl. chunk-boundary states, fused recurrent decode + spec)."""

from __future__ import annotations

import torch

from bench.kernels_check.report import BF16, DEV, Report, _qsl, first_call, timed


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
