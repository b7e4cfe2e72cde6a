"""Engine liveness during a rollout (`--use-fault-tolerance`).

`EngineHealth` is the rollout side's view of which engines are dead. An engine is declared dead
when a request to it fails without an HTTP answer (connection refused or reset: the process died,
e.g. kill -9) or when its `/health` does not answer 200 within `timeout_s` (the process hangs; the
check runs every `interval_s` in `monitor`). Declaring an engine dead wakes every request waiting
on it (`dead_event(k)`), and `ClientPool.generate` sends those requests again, unchanged, to a live
engine: the same sample and the same input ids (its prompt, plus the response so far for a continued
sample), so a sample is filled exactly once and a lost request costs only the tokens it had made.

Restarting a dead engine is the orchestration layer's job (a new process in the same placement, a
new weight-update group, the current weights, then `revive(k)`); this room only routes around it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Sequence

from slime_rl.engines.client import AsyncEngineClient, EngineError


class NoLiveEngineError(RuntimeError):
    """Every engine is dead: nothing can be retried."""


class EngineHealth:
    """Which of `n` engines are dead, why, and how many requests were sent again because of it."""

    def __init__(self, n: int, dead: Iterable[int] = (), interval_s: float = 10.0, timeout_s: float = 5.0) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError(f"health check interval {interval_s} / timeout {timeout_s}: must be > 0")
        self.n = n
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.reasons: dict[int, str] = {k: "dead before this rollout" for k in dead}
        self.retried = 0  # requests sent again after their engine died
        self._events: dict[int, asyncio.Event] = {}

    @property
    def dead(self) -> set[int]:
        return set(self.reasons)

    def is_alive(self, k: int) -> bool:
        return k not in self.reasons

    def alive(self) -> list[int]:
        return [k for k in range(self.n) if k not in self.reasons]

    def dead_event(self, k: int) -> asyncio.Event:
        """Set once engine `k` is declared dead (already set if it is)."""
        event = self._events.setdefault(k, asyncio.Event())
        if k in self.reasons:
            event.set()
        return event

    def mark_dead(self, k: int, reason: str) -> None:
        if k in self.reasons:
            return
        self.reasons[k] = reason
        print(f"[slime_rl] engine {k} declared dead: {reason}; its requests go to the other engines", flush=True)
        self.dead_event(k).set()

    def revive(self, k: int) -> None:
        """Engine `k` was restarted (and has the current weights): route to it again."""
        self.reasons.pop(k, None)
        self._events.pop(k, None)

    def failed(self, k: int, error: EngineError) -> bool:
        """A request to engine `k` raised `error`: True (and `k` is dead) when the engine gave no HTTP
        answer at all, so the request should go elsewhere; False for an HTTP error, which is the
        request's own fault and would fail anywhere."""
        if error.status is not None:
            return False
        self.mark_dead(k, str(error))
        return True

    async def check(self, clients: Sequence[AsyncEngineClient]) -> None:
        """One round: GET /health on every live engine, each bounded by `timeout_s`."""
        async def probe(k: int) -> None:
            try:
                ok = await asyncio.wait_for(clients[k].health(), self.timeout_s)
            except TimeoutError:
                self.mark_dead(k, f"/health did not answer within {self.timeout_s:g} s")
                return
            if not ok:
                self.mark_dead(k, "/health did not answer 200")

        await asyncio.gather(*(probe(k) for k in self.alive()))

    async def monitor(self, clients: Sequence[AsyncEngineClient]) -> None:
        """Check every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check(clients)

    @contextlib.asynccontextmanager
    async def watching(self, clients: Sequence[AsyncEngineClient]):
        """Run `monitor` in the background for the duration of the block."""
        task = asyncio.create_task(self.monitor(clients))
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def metrics(self) -> dict[str, float]:
        return {"rollout/engines_dead": float(len(self.reasons)), "rollout/requests_retried": float(self.retried)}
