"""The Buffer between rollout and training: finished steps' batches, keyed by step.

Plain class + a Ray actor wrapper, so the logic is tested without Ray.
"""

from __future__ import annotations

from typing import Any

import ray


class StepBuffer:
    """Batches by step; `get` leaves the batch in place until every trainer rank has read it."""

    def __init__(self) -> None:
        self._batches: dict[int, dict[str, Any]] = {}
        self._reads: dict[int, int] = {}

    def put(self, step: int, batch: dict[str, Any]) -> None:
        if step in self._batches:
            raise KeyError(f"step {step} is already in the buffer")
        self._batches[step] = batch
        self._reads[step] = 0

    def get(self, step: int, readers: int = 1) -> dict[str, Any]:
        batch = self._batches[step]
        self._reads[step] += 1
        if self._reads[step] >= readers:
            del self._batches[step], self._reads[step]
        return batch

    def steps(self) -> list[int]:
        return sorted(self._batches)


@ray.remote(num_cpus=0)
class Buffer(StepBuffer):
    pass
