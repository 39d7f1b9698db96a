"""What the HTTP and gRPC front ends need from the serving side: one async token stream per request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from engine.request import TokenLogprobs
from engine.sampling_params import SamplingParams


class GenerationError(Exception):
    """A request failed after it was accepted (worker died, transfer refused...). ``code`` is an
    HTTP-like status the front end maps to its own error shape."""

    def __init__(self, message: str, code: int = 500) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class SpeculativeParams:
    """Per-request speculative decoding settings. Only decode workers may receive them."""

    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    speculative: SpeculativeParams | None = None
    deadline_s: float | None = None
    """Seconds the whole request may take; None: no deadline."""
    cache_salt: str = ""
    """Separates this request's prefix-cache namespace (e.g. per tenant)."""


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of one request (usually one); the last event has finished=True."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finished: bool = False
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort'


class GenerationBackend(Protocol):
    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Stream the request's tokens. Closing the iterator early (client gone) cancels the request
        everywhere. Raises GenerationError on failure."""
        ...
