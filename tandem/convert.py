"""Wire messages <-> engine types."""

from __future__ import annotations

from engine.request import TokenLogprobs
from engine.sampling_params import SamplingParams
from tandem.rpc import common_pb2 as cpb


def params_to_pb(p: SamplingParams) -> cpb.SamplingParams:
    m = cpb.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        m.seed = p.seed
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    return m


def params_from_pb(m: cpb.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the bad field."""
    return SamplingParams(
        max_tokens=m.max_tokens,
        temperature=m.temperature,
        top_k=m.top_k,
        top_p=m.top_p if m.top_p else 1.0,
        seed=m.seed if m.HasField("seed") else None,
        stop_token_ids=tuple(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        logprobs=m.logprobs if m.HasField("logprobs") else None,
    )


def logprobs_to_pb(lp: TokenLogprobs) -> cpb.TokenLogprob:
    return cpb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[cpb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def logprobs_from_pb(m: cpb.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(m.token_id, m.logprob, tuple((t.token_id, t.logprob) for t in m.top))
