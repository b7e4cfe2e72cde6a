"""The n samples of a group in one /generate request (SGLang's batch form) against a real embedded
engine: under deterministic rollout the tokens and finish reasons are identical to one request per
sample and the log-probs agree to float32 rounding (the engine's CPU forward is not batch-invariant
in the last bit: the per-sample path run twice differs by up to ~5e-7 too, as rows meet different
batch neighbours; measured while writing this test); one request per group is what goes over the
wire; an abort of one sample's rid cuts that sample alone; the per-engine cap counts samples, so a
group larger than the cap is split."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from rollout_testlib import row, start_server, with_clients

from slime_rl.config import RolloutConfig
from slime_rl.engines.client import AsyncEngineClient
from slime_rl.rollout.custom import generate_default
from slime_rl.rollout.generate import generate_groups, make_groups, run_group
from slime_rl.rollout.partial import ABORTED, COMPLETED, TRUNCATED, status
from slime_rl.rollout.routing import ClientPool, LoadBalancer


@pytest.fixture(scope="module")
def server(tiny_qwen2):
    s = start_server(tiny_qwen2, random_seed=5, max_running_requests=32)
    yield s
    s.shutdown()


class CountingClient(AsyncEngineClient):
    """The real client, recording the shape of every /generate it sends."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.generate_sizes: list[int | None] = []  # None: a single request

    def generate(self, input_ids=None, sampling_params=None, **kw):
        batch = bool(input_ids) and isinstance(input_ids[0], list)
        self.generate_sizes.append(len(input_ids) if batch else None)
        return super().generate(input_ids=input_ids, sampling_params=sampling_params, **kw)


async def per_sample(sample, sampling_params, pool):
    """The built-in one-turn generation through the per-sample path (any other function object is
    a custom generate function to run_group)."""
    return await generate_default(sample, sampling_params, pool)


def rollout(url: str, per_engine: int, generate_fn=None, n: int = 4, rows: int = 3) -> tuple[list, list]:
    cfg = RolloutConfig(n_samples_per_prompt=n, max_response_len=24, temperature=1.0, concurrency_per_engine=per_engine)

    async def body(_):
        client = CountingClient(url, timeout=120)
        try:
            pool = ClientPool([client], tokenizer=None, per_engine=per_engine, sample_seed=1234)
            groups = await generate_groups([client], [row(k) for k in range(rows)], cfg, lambda s: 0.0, None,
                                           progress=False, pool=pool, generate_fn=generate_fn)
            return groups, client.generate_sizes
        finally:
            await client.aclose()

    return with_clients([], body)


def flat(groups):
    return [(s.index, s.response_ids, s.finish_reason) for g in groups for s in g]


def assert_same(a, b) -> None:
    """Identical tokens and finish reasons; log-probs equal to float32 batch-composition rounding
    (a wrong context or seed moves them by 1e-2 and more)."""
    assert flat(a) == flat(b)
    for x, y in zip((s for g in a for s in g), (s for g in b for s in g), strict=True):
        assert len(x.rollout_logprobs) == len(y.rollout_logprobs)
        assert max((abs(p - q) for p, q in zip(x.rollout_logprobs, y.rollout_logprobs, strict=True)),
                   default=0.0) <= 2e-6


def test_grouped_equals_per_sample(server):
    grouped, sizes = rollout(server.url, per_engine=8)
    single, single_sizes = rollout(server.url, per_engine=8, generate_fn=per_sample)
    assert sizes == [4, 4, 4]  # one batch request per group of 4
    assert single_sizes == [None] * 12  # the per-sample path sends the single form
    assert_same(grouped, single)
    assert all(len(s.response_ids) > 0 for g in grouped for s in g)
    # the samples of one group differ (each carries its own sampling_seed)
    assert len({tuple(s.response_ids) for s in grouped[0]}) > 1


def test_a_group_larger_than_the_cap_is_split(server):
    grouped, sizes = rollout(server.url, per_engine=3, n=5, rows=1)
    assert sorted(sizes) == [2, 3]
    single, _ = rollout(server.url, per_engine=3, n=5, rows=1, generate_fn=per_sample)
    assert_same(grouped, single)


def test_an_abort_of_one_rid_cuts_that_sample_alone(server):
    async def body(clients):
        pool = ClientPool(clients, tokenizer=None, per_engine=8)
        group = make_groups([row(7)], 3, itertools.count(), itertools.count(40))[0]
        # long enough that the abort lands mid-generation even on a loaded machine (400 was not)
        params = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 1.0}
        task = asyncio.create_task(run_group(pool, group, params, generate_default, lambda s: 0.0))
        while len(pool.live_rids(40)) < 3:
            await asyncio.sleep(0.001)
        victim = min(pool.live_rids(40))  # the rid of sample index 0
        # the rid is live on our side before the engine has queued it, and aborting a rid the engine
        # does not know yet is a no-op (as in SGLang): abort until the group's request answers
        while not task.done():
            await clients[0].abort_request(rid=victim)
            await asyncio.wait({task}, timeout=0.05)
        await task
        return group

    group = with_clients([server.url], body)
    assert status(group[0]) == ABORTED and len(group[0].response_ids) < 1500 - 8  # maybe 0: cut before its first token
    assert [status(s) for s in group[1:]] == [TRUNCATED, TRUNCATED]
    assert all(len(s.response_ids) == len(s.rollout_logprobs) for s in group)
    assert COMPLETED not in {status(s) for s in group}


def test_balancer_counts_samples_first_come_first_served():
    async def go():
        lb = LoadBalancer([object()], per_engine=4)
        a = await lb.acquire(3)
        order = []

        async def take(w, name):
            i = await lb.acquire(w)
            order.append(name)
            return i

        big = asyncio.create_task(take(4, "big"))
        await asyncio.sleep(0)
        small = asyncio.create_task(take(1, "small"))  # fits now, but waits behind the big one
        await asyncio.sleep(0)
        assert order == [] and lb.in_flight == [3]
        lb.release(a, 3)
        await big
        assert order == ["big"] and lb.in_flight == [4] and lb.peak == [4]
        lb.release(0, 4)
        await small
        assert order == ["big", "small"] and lb.sent == [8]
        with pytest.raises(ValueError, match="concurrency-per-engine"):
            await lb.acquire(5)
        # a waiter cancelled in the queue does not hold the ones behind it
        lb.release(0, 1)
        held = await lb.acquire(4)
        w1 = asyncio.create_task(take(2, "w1"))
        w2 = asyncio.create_task(take(1, "w2"))
        await asyncio.sleep(0)
        w1.cancel()
        lb.release(held, 3)
        await w2
        assert order[-1] == "w2" and lb.in_flight == [2]

    asyncio.run(go())
