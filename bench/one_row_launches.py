"""The thirty-third session's one-row launches against what they replace, each alone on the GPU (no model, no
checkpoint: ~30 s on a fresh machine).

    python -m bench.one_row_launches [--out F.json]

- MLA's W_UK product with FlashMLA's rope columns: cuBLAS's one-row batched GEMM + a copy vs ``head_gemv`` (tail);
- MLA's W_UV^T product: cuBLAS's batched GEMM vs ``head_gemv``;
- the embedding gather + the first input norm: torch's indexing + fla's norm vs ``embed_rms_norm``;
- Qwen3's q / k norms, RoPE and K | V write: the model's ops vs ``qk_norm_rope_write`` (weights: none to stream).
Each form's launches are captured ``iters`` times in one CUDA graph (``bench.graph_time``); every call reads
another of ``COPIES`` weight copies, together larger than L2, so the weights come from HBM as in a decode step."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from bench.graph_time import graph_us
from kernels.embed_norm.triton import embed_rms_norm
from kernels.gemv.heads import head_gemv

COPIES = 16
H, NOPE, ROPE, R, V_DIM = 32, 128, 64, 512, 128  # Kimi-Linear's MLA
VOCAB, HIDDEN = 163_840, 2304


def _cycle(items: list) -> Callable[[], torch.Tensor]:
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % len(items)
        return items[state["i"]]

    return nxt


def mla_cases() -> dict[str, float]:
    dev, dt = "cuda", torch.bfloat16
    kv_b = [torch.randn(H * (NOPE + V_DIM), R, device=dev, dtype=dt) * R**-0.5 for _ in range(COPIES)]
    views = [w.view(H, NOPE + V_DIM, R) for w in kv_b]
    w_uk = _cycle([v[:, :NOPE] for v in views])
    w_uv = _cycle([v[:, NOPE:] for v in views])
    q = torch.randn(1, H, NOPE + ROPE, device=dev, dtype=dt)
    q_buf = torch.empty(1, H, R + ROPE, device=dev, dtype=dt)
    o_lat = torch.randn(1, H, R, device=dev, dtype=dt)
    o = torch.empty(1, H, V_DIM, device=dev, dtype=dt)

    def uk_bmm():
        torch.bmm(q[..., :NOPE].transpose(0, 1), w_uk(), out=q_buf[..., :R].transpose(0, 1))
        q_buf[..., R:].copy_(q[..., NOPE:])

    def uk_gemv():
        head_gemv(q[0, :, :NOPE], w_uk(), out=q_buf[0, :, :R], tail=q[0, :, NOPE:])

    def uv_bmm():
        torch.bmm(o_lat.transpose(0, 1), w_uv().transpose(1, 2), out=o.transpose(0, 1))

    def uv_gemv():
        head_gemv(o_lat[0], w_uv().transpose(1, 2), out=o[0])

    w0 = views[0][:, :NOPE]  # the two forms on the same weight copy (the cycled calls each take the next one)
    head_gemv(q[0, :, :NOPE], w0, out=q_buf[0, :, :R], tail=q[0, :, NOPE:])
    want = q_buf.clone()
    torch.bmm(q[..., :NOPE].transpose(0, 1), w0, out=q_buf[..., :R].transpose(0, 1))
    q_buf[..., R:].copy_(q[..., NOPE:])
    err = (want.float() - q_buf.float()).abs().max().item()
    return {
        "w_uk_rope: bmm + copy": graph_us(uk_bmm, iters=COPIES * 4),
        "w_uk_rope: head_gemv": graph_us(uk_gemv, iters=COPIES * 4),
        "w_uv: bmm": graph_us(uv_bmm, iters=COPIES * 4),
        "w_uv: head_gemv": graph_us(uv_gemv, iters=COPIES * 4),
        "w_uk max |diff| (bf16)": err,
    }


def embed_cases() -> dict[str, float]:
    from fla.modules.norm.layernorm import layer_norm_fwd

    dev, dt = "cuda", torch.bfloat16
    emb = torch.randn(VOCAB, HIDDEN, device=dev, dtype=dt)
    norm_w = torch.rand(HIDDEN, device=dev, dtype=dt) + 0.5
    ids = _cycle([torch.randint(0, VOCAB, (1,), device=dev) for _ in range(COPIES)])

    def separate():
        rows = emb[ids()]
        layer_norm_fwd(rows, norm_w, None, eps=1e-6, is_rms_norm=True)

    def fused():
        embed_rms_norm(emb, ids(), norm_w, 1e-6)

    return {
        "embed + norm: indexing + fla norm": graph_us(separate, iters=COPIES * 4),
        "embed + norm: embed_rms_norm": graph_us(fused, iters=COPIES * 4),
    }


def qwen3_cases() -> dict[str, float]:
    """Qwen3-8B's attention input at one token: the model's ops (fla's norms, the rotary's elementwise ops, the K | V
    stack and scatter) vs ``qk_norm_rope_write``."""
    from engine.backends.norm import FlaNormBackend
    from engine.models.layers import RotaryEmbedding
    from kernels.paged_attention.qk_norm_rope import qk_norm_rope_write

    dev, dt, h, kvh, d = "cuda", torch.bfloat16, 32, 8, 128
    packed = torch.randn(1, (h + 2 * kvh) * d, device=dev, dtype=dt)
    q, k, v = (x.view(1, -1, d) for x in packed.split([h * d, kvh * d, kvh * d], dim=-1))
    qw, kw = (torch.rand(d, device=dev, dtype=dt) + 0.5 for _ in range(2))
    rotary = RotaryEmbedding(d, 1_000_000.0).to(dev)
    pos = torch.tensor([4095], device=dev)
    cache = torch.zeros(64, 16, 2, kvh, d, device=dev, dtype=dt)
    slots = torch.tensor([100], device=dev)
    norms = FlaNormBackend()

    def model_ops():
        qn, kn = norms.rms_norm(q, qw, 1e-6), norms.rms_norm(k, kw, 1e-6)
        _q, kr = rotary(qn, kn, pos)
        cache.view(-1, 2, kvh, d)[slots] = torch.stack([kr, v], dim=1)

    def fused():
        qk_norm_rope_write(q, k, v, qw, kw, 1e-6, pos, rotary.inv_freq, cache, slots)

    return {"qwen3 qk norm + rope + kv write: model ops": graph_us(model_ops), "qwen3 ...: fused": graph_us(fused)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.one_row_launches", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    res = {"device": torch.cuda.get_device_name(), **mla_cases(), **embed_cases(), **qwen3_cases()}
    for k, v in res.items():
        print(f"{k:40s} {v if isinstance(v, str) else f'{v:.2f}'}")
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
