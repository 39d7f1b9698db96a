"""Verification of draft tokens against the target's logits.

Our drafters propose deterministic tokens (q is a point mass on the draft), so speculative rejection
sampling reduces to: accept draft d with probability p(d); on rejection, sample from p with d removed
(renormalised, i.e. norm(max(0, p - q))); after k acceptances, sample a bonus token from the last row.
This preserves the target distribution exactly. Greedy accepts while the draft equals the argmax, so
the output is the non-speculative greedy output.
"""

from __future__ import annotations

import torch

from engine.request import Request, TokenLogprobs
from engine.sampler import filtered_probs, step_generator


def verify_drafts(logits: torch.Tensor, drafts: list[int], req: Request, rng: torch.Generator) -> tuple[list[int], int]:
    """logits [k+1, V] fp32 for the positions of (last token, d_1 .. d_k). Returns (tokens to append:
    the accepted drafts then one target token, number of accepted drafts)."""
    p = req.params
    if p.greedy:
        target = torch.argmax(logits, dim=-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == target[a]:
            a += 1
        return drafts[:a] + [target[a]], a
    base = len(req.output_token_ids)
    for i, d in enumerate(drafts):
        probs = filtered_probs(logits[i], p.temperature, p.top_k, p.top_p)
        gen = step_generator(req, base + i, rng)
        if float(torch.rand((), generator=gen)) < float(probs[d]):
            continue
        residual = probs.clone()
        residual[d] = 0.0
        if float(residual.sum()) <= 0.0:  # p was a point mass on d: nothing else can be drawn
            return drafts[: i + 1], i + 1
        return drafts[:i] + [int(torch.multinomial(residual / residual.sum(), 1, generator=gen))], i
    probs = filtered_probs(logits[len(drafts)], p.temperature, p.top_k, p.top_p)
    gen = step_generator(req, base + len(drafts), rng)
    return drafts + [int(torch.multinomial(probs, 1, generator=gen))], len(drafts)


def token_logprobs(logits: torch.Tensor, tokens: list[int], n_top: int) -> list[TokenLogprobs]:
    out = []
    for row, tok in zip(logits, tokens, strict=False):
        lp = torch.log_softmax(row.float(), dim=-1)
        top = torch.topk(lp, n_top) if n_top else None
        pairs = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else ()
        out.append(TokenLogprobs(tok, float(lp[tok]), pairs))
    return out
