"""What the engine returns per request and step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request, TokenLogprobs


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprobs]
    num_preemptions: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0
    aux_hidden: torch.Tensor | None = None
    """The target's taps (aux_layer_ids order) at the position that produced the newest token."""
    aux_layer_ids: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the target's token)."""
        return (self.num_accepted + self.num_verify_steps) / self.num_verify_steps if self.num_verify_steps else 0.0


def request_output(r: Request) -> RequestOutput:
    return RequestOutput(
        r.request_id,
        r.prompt_token_ids,
        list(r.output_token_ids),
        r.is_finished,
        r.finish_reason,
        list(r.output_logprobs),
        r.num_preemptions,
        r.num_drafted,
        r.num_accepted,
        r.num_verify_steps,
        r.last_aux,
        r.last_aux_layers,
    )
