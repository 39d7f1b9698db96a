"""The q|k|v conv + q/k L2 norm in one launch (kernels/short_conv/planes.py) against fla's conv per plane then
fla's ``l2norm_fwd`` on q and k, on the GPU (the fifteenth session's experiment; docs/PERFORMANCE.md).

    python -m bench.conv_planes --tokens 8192 32768
"""

from __future__ import annotations

import argparse

import torch

from bench.gpu_kernels_check import kernel_ms
from bench.mid import roofline

HEADS, HEAD_DIM, WIDTH = 32, 128, 4


def conv(tokens: int, device: torch.device, copy_bw: float) -> dict:
    from fla.modules.norm.l2norm import l2norm_fwd

    from kernels.short_conv.fla_adapter import conv_step, short_conv_prefill_fla
    from kernels.short_conv.planes import conv_planes

    p = HEADS * HEAD_DIM
    gen = torch.Generator(device=device).manual_seed(0)
    wide = torch.randn(tokens, 3 * p + 512, generator=gen, device=device).to(torch.bfloat16)
    x = wide[:, : 3 * p]  # the q|k|v columns of the packed projection's output
    weight = torch.randn(3 * p, WIDTH, generator=gen, device=device).to(torch.bfloat16)
    state = torch.randn(2, 3 * p, WIDTH - 1, generator=gen, device=device).to(torch.bfloat16)
    step = conv_step([1], [0, tokens], [True], device)

    def replaced() -> list[torch.Tensor]:
        ys = list(short_conv_prefill_fla(x, weight, state, step, planes=3))
        for j in range(2):
            ys[j] = l2norm_fwd(ys[j].unflatten(1, (HEADS, HEAD_DIM)))[0].flatten(1)
        return ys

    def fused() -> tuple[torch.Tensor, ...]:
        return conv_planes(x, weight, state, step, planes=3, head_dim=HEAD_DIM)

    # the windows: both read the same slot; the replaced path also writes it (write_windows), the fused one
    # leaves that launch to its caller: time it beside, as the engine runs it
    from kernels.short_conv.triton import write_windows

    def fused_and_windows() -> tuple[torch.Tensor, ...]:
        out = fused()
        write_windows(x, weight, state, step.slots, step.qsl, step.has_init)
        return out

    got = fused()  # first: the replaced path writes the windows both read
    want = replaced()
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(want, got, strict=True))
    frac = max((a != b).float().mean().item() for a, b in zip(want, got, strict=True))
    nbytes = 2 * x.numel() * x.element_size()
    ms_old, ms_new = kernel_ms(replaced), kernel_ms(fused_and_windows)
    by_tile = {  # (rows a sub-tile, warps): ptxas (sm_90) puts 16 x 4 at 130 registers, 8 x 4 at 96
        f"{bt}x{w}": kernel_ms(
            lambda bt=bt, w=w: conv_planes(x, weight, state, step, head_dim=HEAD_DIM, num_warps=w, block_t=bt)
        )
        for bt in (8, 16, 32)
        for w in (2, 4, 8)
    }
    return {
        "planes_ms_by_tile": by_tile,
        "tokens": tokens,
        "replaced_ms": ms_old,
        "fused_ms": ms_new,
        "replaced_of_copy_bw": nbytes / (ms_old / 1e3) / copy_bw,
        "fused_of_copy_bw": nbytes / (ms_new / 1e3) / copy_bw,
        "max_abs_diff": diff,
        "fraction_differing": frac,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.conv_planes")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    a = p.parse_args(argv)
    device = torch.device("cuda")
    copy_bw = roofline.copy_bandwidth(device)["bytes_per_s"]
    for t in a.tokens:
        print(t, conv(t, device, copy_bw), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
