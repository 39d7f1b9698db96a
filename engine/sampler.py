"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

A seeded request draws token i from a generator seeded by (seed, i), so its tokens do not depend
on batch composition, step boundaries or preemption.
"""

from __future__ import annotations

import torch

from engine.request import Request, TokenLogprobs

_MASK64 = (1 << 63) - 1


def _step_seed(seed: int, index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) & _MASK64


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._rng = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[tuple[int, TokenLogprobs | None]]:
        """logits [S, V] fp32 (row i belongs to requests[i]). Greedy rows take their argmax where the
        logits are (one op for the batch, S ids back to the host); only rows that draw or report
        logprobs are copied to the host (on a GPU a full [S, V] copy per step costs more than the step)."""
        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        tokens: list[int] = [0] * len(requests)
        if greedy:
            rows = logits if len(greedy) == len(requests) else logits[greedy]
            for i, t in zip(greedy, rows.argmax(dim=-1).tolist(), strict=True):
                tokens[i] = t  # argmax: the first of equal maxima, on every device
        need = [i for i, r in enumerate(requests) if not r.params.greedy or r.params.logprobs is not None]
        host = dict(zip(need, logits[need].float().cpu(), strict=True)) if need else {}
        out = []
        for i, req in enumerate(requests):
            p = req.params
            token = tokens[i] if p.greedy else self._draw(host[i], req)
            lp = None
            if p.logprobs is not None:
                logprobs = torch.log_softmax(host[i], dim=-1)
                top = torch.topk(logprobs, p.logprobs) if p.logprobs else None
                lp = TokenLogprobs(
                    token,
                    float(logprobs[token]),
                    tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else (),
                )
            out.append((token, lp))
        return out

    def _draw(self, row: torch.Tensor, req: Request) -> int:
        probs = filtered_probs(row, req.params.temperature, req.params.top_k, req.params.top_p)
        gen = step_generator(req, len(req.output_token_ids), self._rng)
        return int(torch.multinomial(probs, 1, generator=gen))


def step_generator(req: Request, index: int, default: torch.Generator) -> torch.Generator:
    """The generator for output token `index` of a request: seeded by (seed, index) when the request
    has a seed, so batching, preemption and step boundaries cannot change its tokens."""
    if req.params.seed is None:
        return default
    return torch.Generator().manual_seed(_step_seed(req.params.seed, index))


def filtered_probs(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution a non-greedy request samples from, after temperature, top-k and top-p."""
    logits = row / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return torch.softmax(logits, dim=-1)
