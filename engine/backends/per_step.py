"""Values derived from one step's batch, computed on the first layer that asks and reused by the others."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.forward_batch import ForwardBatch


class PerStep:
    """Values derived from one ForwardBatch, computed once and shared by all layers of the step."""

    def __init__(self) -> None:
        self._batch: ForwardBatch | None = None
        self._values: dict[Any, Any] = {}

    def get(self, batch: ForwardBatch, key: Any, build: Callable[[], Any]) -> Any:
        self._switch(batch)
        if key not in self._values:
            self._values[key] = build()
        return self._values[key]

    def put(self, batch: ForwardBatch, key: Any, value: Any) -> None:
        """A value built elsewhere (a CUDA graph's fixed-address metadata) for ``batch``'s calls."""
        self._switch(batch)
        self._values[key] = value

    def _switch(self, batch: ForwardBatch) -> None:
        if batch is not self._batch:  # a new step (the old batch stays referenced, so identity is safe)
            self._batch, self._values = batch, {}
