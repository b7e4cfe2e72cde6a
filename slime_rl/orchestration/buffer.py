"""The Buffer between rollout and training: finished steps' batches, keyed by step.

Plain class + a Ray actor wrapper, so the logic is tested without Ray.
"""

from __future__ import annotations

from typing import Any

import ray


class StepBuffer:
    """Batches by step; a step's batch stays until it has been read `readers` times (by `get` or
    `get_rows`), i.e. by every rank that needs it.

    Ranks add per-sample rows computed during training (PPO: the critic's "values", the policy's
    "returns") with `put_rows`, each rank its own DP shard: a later `get` returns them as one more
    column of the batch, `get_rows` returns just the rows asked for. Every row must have been put
    before it is read (the driver waits for the writing ranks first)."""

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

    def put_rows(self, step: int, key: str, indices: list[int], rows: list) -> None:
        """Set rows `indices` (batch order) of column `key` of step's batch (created on first use)."""
        batch = self._batches[step]
        column = batch.setdefault(key, [None] * len(batch["tokens"]))
        for i, row in zip(indices, rows, strict=True):
            column[i] = row

    def get_rows(self, step: int, key: str, indices: list[int], readers: int = 1) -> list:
        """Rows `indices` of column `key`; counts as one read of the step, like `get`."""
        column = self._batches[step][key]
        missing = [i for i in indices if column[i] is None]
        assert not missing, f"step {step}: no {key!r} rows for samples {missing[:5]} yet"
        rows = [column[i] for i in indices]
        self.get(step, readers)
        return rows

    def steps(self) -> list[int]:
        return sorted(self._batches)


@ray.remote(num_cpus=0)
class Buffer(StepBuffer):
    pass
