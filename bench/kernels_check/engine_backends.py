"""Kernel-check sections: GPU vs reference backends on one mixed ForwardBatch, and tiny models through the
engine (GPU backends vs TANDEM_BACKEND=torch)."""

from __future__ import annotations

import os
import tempfile

import torch

from bench.kernels_check.report import BF16, DEV, Report, _pages, _qsl, timed


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
