"""Reference MoE: sigmoid top-k routing (Kimi / DeepSeek-V3 style) and a per-expert loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sigmoid_topk_route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] fp32 -> (weights [T, k] fp32, expert ids [T, k]).

    The correction bias only picks experts; the weights come from the unbiased scores,
    renormalised first and scaled after.
    """
    scores = router_logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids


def naive_router_partials(x: torch.Tensor, weight: torch.Tensor, split: int) -> torch.Tensor:
    """x [T, H] @ weight [E, H]^T in fp32 as [ceil(H / split), T, E] partial sums over consecutive column ranges
    of ``split`` (kernels/moe/router.py's contract); ``sum_partials`` adds them back in split order."""
    return torch.stack(
        [x[:, s : s + split].float() @ weight[:, s : s + split].float().t() for s in range(0, x.shape[1], split)]
    )


def sum_partials(partials: torch.Tensor) -> torch.Tensor:
    """[S, T, E] -> [T, E]: the partial sums added in split order (the route kernel's order)."""
    out = partials[0].clone()
    for p in partials[1:]:
        out += p
    return out


def naive_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """x [T, H]; w1/w3 (gate/up) [E, I, H]; w2 (down) [E, H, I]. SwiGLU experts, weighted sum."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        pos, slot = torch.where(ids == e)
        h = x[pos]
        y = F.linear(F.silu(F.linear(h, w1[e])) * F.linear(h, w3[e]), w2[e])
        out.index_add_(0, pos, (y * weights[pos, slot, None]).to(out.dtype))
    return out
