"""Kernel-check sections: the KDA layers' short conv, norms / gate / SwiGLU, and state-slot copies."""

from __future__ import annotations

import torch

from bench.kernels_check.report import BF16, DEV, Report, _qsl, timed


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
