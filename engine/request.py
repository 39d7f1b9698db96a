"""A request's state as it moves through the scheduler: tokens, progress, and what it holds."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import numpy as np

from engine.sampling_params import SamplingParams


class InvalidRequestError(ValueError):
    """A request the engine refuses; other requests are unaffected."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt_array: np.ndarray | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self._prompt_array = prompt_array
        """The prompt as int64 numpy (built once: by validation, or on first use); long prefill chunks are
        sliced from it instead of converting 8k-64k Python ints again before the step's first kernel."""
        self.params = params
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[TokenLogprobs] = []
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None  # 'stop' | 'length' | 'abort'
        self.num_computed_tokens = 0
        """Tokens whose KV / state is in the caches."""
        self.page_ids: list[int] = []
        self.slot_ids: list[int] = []
        """KDA state slots; slot_ids[0] holds the running state."""
        self.num_preemptions = 0
        # prefix caching
        self.hash_namespace = b""
        self.block_hashes: list[bytes] = []
        """Chained hashes of the full pages so far (computed lazily)."""
        self.kv_cached_tokens = 0
        """KV of positions below this came from the prefix cache and is not rewritten."""
        self.fork_slot: int | None = None
        """Checkpoint slot to copy into slot_ids[0] before the next step runs."""
        self.pending_checkpoints: list[tuple[int, int]] = []
        """(rung position, slot) written by the running step, filed when it ends (checkpoint hold)."""
        self.prefix_hit_tokens = 0
        # speculative decoding
        self.draft_tokens: list[int] = []
        """Proposed for the next step; verified by the target, never part of the output until accepted."""
        self.num_drafted = 0
        self.num_accepted = 0
        self.num_verify_steps = 0
        self.last_aux = None
        self.last_aux_layers: tuple[int, ...] = ()
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None

    def prompt_array(self) -> np.ndarray:
        if self._prompt_array is None or len(self._prompt_array) != len(self.prompt_token_ids):
            self._prompt_array = np.asarray(self.prompt_token_ids, dtype=np.int64)
        return self._prompt_array

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={len(self.prompt_token_ids)}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens}, {self.status.value})"
        )
