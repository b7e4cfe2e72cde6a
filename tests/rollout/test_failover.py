"""--use-fault-tolerance on the rollout side, one room: a request whose engine dies (no HTTP answer)
or hangs (its /health times out) is sent again, unchanged, to a live engine; every sample gets
exactly one answer; without fault tolerance the error still surfaces. The engines here are
in-process fakes (the real kill -9 of a real engine is tests/e2e/test_fault.py)."""

from __future__ import annotations

import asyncio

import pytest

from slime_rl.data import Sample
from slime_rl.engines.client import EngineError
from slime_rl.rollout.health import EngineHealth, NoLiveEngineError
from slime_rl.rollout.routing import ClientPool


class Engine:
    """Answers /generate with the input ids echoed; `mode` "dies" fails after `after` answers
    without an HTTP answer (as a killed process does), "hangs" stops answering anything."""

    def __init__(self, name: str, mode: str = "ok", after: int = 0) -> None:
        self.base_url, self.mode, self.after = name, mode, after
        self.answered: list[str] = []  # rids answered
        self.received = 0

    async def generate(self, input_ids, sampling_params, return_logprob, rid, image_data=None):
        self.received += 1
        await asyncio.sleep(0.01)
        if self.mode != "ok" and len(self.answered) >= self.after:
            if self.mode == "dies":
                raise EngineError(self.base_url, "/generate", None, "ReadError: connection reset")
            await asyncio.sleep(3600)
        self.answered.append(rid)
        return {"text": "", "output_ids": list(input_ids),
                "meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [], "rid": rid}}

    async def health(self) -> bool:
        if self.mode == "hangs" and len(self.answered) >= self.after:
            await asyncio.sleep(3600)
        return True


def run_samples(engines, n: int, health: EngineHealth | None, per_engine: int = 4):
    samples = [Sample(index=i, group_index=i // 2, prompt="", prompt_ids=[i]) for i in range(n)]

    async def main():
        pool = ClientPool(engines, tokenizer=None, per_engine=per_engine, health=health)
        if health is None:
            return pool, await asyncio.gather(*(pool.generate(s, [s.index], {}) for s in samples))
        async with health.watching(engines):
            outs = await asyncio.gather(*(pool.generate(s, [s.index], {}) for s in samples))
        return pool, outs

    return asyncio.run(main())


@pytest.mark.parametrize("mode", ["dies", "hangs"])
def test_requests_of_a_failed_engine_are_answered_once_by_the_others(mode):
    engines = [Engine("e0"), Engine("e1", mode=mode, after=3), Engine("e2")]
    health = EngineHealth(3, interval_s=0.05, timeout_s=0.2)
    pool, outs = run_samples(engines, 40, health)
    # every sample answered, with its own input (its prompt), exactly once across the engines
    assert [o["output_ids"] for o in outs] == [[i] for i in range(40)]
    rids = [rid for e in engines for rid in e.answered]
    assert len(rids) == len(set(rids)) == 40
    sample_of = sorted(int(r.split("-s")[1].split("-")[0]) for r in rids)
    assert sample_of == list(range(40))  # no sample answered twice, none lost
    assert health.dead == {1} and len(engines[1].answered) == 3
    # the failed engine had requests in flight (4 per engine), and each of those was sent again
    lost = engines[1].received - 3
    assert lost >= 1 and health.retried == lost
    assert pool.metrics()["rollout/requests_retried"] == lost
    assert pool.metrics()["rollout/engines_dead"] == 1


def test_an_engine_dead_before_the_rollout_gets_nothing():
    engines = [Engine("e0"), Engine("e1")]
    health = EngineHealth(2, dead=[0], interval_s=10, timeout_s=1)
    _, outs = run_samples(engines, 6, health)
    assert len(outs) == 6 and engines[0].received == 0 and len(engines[1].answered) == 6


def test_all_engines_dead_is_a_clear_error():
    engines = [Engine("e0", mode="dies"), Engine("e1", mode="dies")]
    with pytest.raises(NoLiveEngineError, match="every rollout engine is dead"):
        run_samples(engines, 4, EngineHealth(2, interval_s=10, timeout_s=1))


def test_without_fault_tolerance_the_engine_error_surfaces():
    with pytest.raises(EngineError, match="connection reset"):
        run_samples([Engine("e0"), Engine("e1", mode="dies")], 8, None)


def test_http_errors_are_not_retried():
    """A 400 is the request's fault: another engine would refuse it too, so the engine stays alive."""
    health = EngineHealth(2, interval_s=10, timeout_s=1)
    assert health.failed(0, EngineError("u", "/generate", 400, "bad")) is False and health.dead == set()
    assert health.failed(0, EngineError("u", "/generate", None, "refused")) is True and health.dead == {0}
    health.revive(0)
    assert health.dead == set() and not health.dead_event(0).is_set()
