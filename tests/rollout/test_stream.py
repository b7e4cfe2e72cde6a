"""--fully-async's GroupStream against a real embedded engine: generation goes on between takes; a weight
update that lands while groups are in flight (pause with abort, new version, continue) interrupts them and
they go on under the new weights, every token tagged with the version that sampled it; staleness is the
trainer's version minus a group's oldest token version, and --max-staleness drops what is older."""

from __future__ import annotations

import asyncio

import pytest
from rollout_testlib import feeder, row, start_server, with_clients

from slime_rl.engines.client import AsyncEngineClient
from slime_rl.rollout.custom import generate_default
from slime_rl.rollout.options import RolloutOptions
from slime_rl.rollout.partial import COMPLETED, TRUNCATED, status, token_versions
from slime_rl.rollout.routing import ClientPool
from slime_rl.rollout.stream import GroupStream, oldest_version, version_number

LONG = 160  # tokens per response (ignore_eos): long enough that a pause lands while groups are in flight


@pytest.fixture(scope="module")
def server(tiny_qwen2):
    s = start_server(tiny_qwen2, random_seed=5, max_running_requests=32)
    yield s
    s.shutdown()


def test_version_numbers():
    assert version_number("7") == 7 and version_number("default") == 0


def test_generation_goes_on_across_updates_and_staleness_is_bounded(server):
    rows = [row(k, n=6) for k in range(8)]
    next_rows, _ = feeder(rows)
    opts = RolloutOptions(rollout_batch_size=2, n_samples_per_prompt=2, max_response_len=LONG, fully_async=True,
                          extra_sampling_params={"ignore_eos": True})

    async def body(clients: list[AsyncEngineClient]):
        pool = ClientPool(clients, server.tokenizer, 64)
        stream = GroupStream(pool, next_rows, opts, lambda s: float(len(s.response_ids)), generate_default, None)
        stream.start()
        first, m0 = await stream.take(2, version=0)
        # the stream refilled at once: the next two groups are generating while "the trainer trains"
        await asyncio.sleep(0.2)
        in_flight = len(stream.running)
        control = clients[0]
        await control.pause_generation()  # the weight sync: in-flight requests come back aborted
        await control.update_weight_version("1", abort_all_requests=False)
        await control.continue_generation()
        second, m1 = await stream.take(2, version=1)
        # two versions later the groups that started under version 0 are too stale for --max-staleness 1
        third, m2 = await stream.take(2, version=2, max_staleness=1)
        # at version 3 every group left (sampled under version 1 at the latest) is 2 versions old: all dropped,
        # until the prompts run out
        fourth, m3 = await stream.take(2, version=3, max_staleness=1)
        await stream.close()
        return first, m0, in_flight, second, m1, third, m2, fourth, m3

    first, m0, in_flight, second, m1, third, m2, fourth, m3 = with_clients([server.url], body)
    assert in_flight == 2
    assert len(first) == 2 and m0["rollout/staleness_max"] == 0 and m0["rollout/stale_groups_dropped"] == 0
    for g in first:
        assert all(token_versions(s) == ["default"] * LONG for s in g)
    # the update landed with both groups in flight: each went on under version 1, its tokens tagged so (a
    # sample the engine had not started yet has only version-1 tokens)
    assert m1["rollout/groups_continued_after_update"] >= 2
    assert len(second) == 2 and m1["rollout/staleness_max"] == 1
    spanning = 0
    for g in second:
        for s in g:
            versions = token_versions(s)
            n0 = versions.count("default")
            assert versions == ["default"] * n0 + ["1"] * (LONG - n0) and n0 < LONG, versions
            assert status(s) == TRUNCATED and s.response_length == LONG and s.reward == float(LONG)
            assert len(s.rollout_logprobs) == len(s.loss_mask) == LONG and all(s.loss_mask)
        age = 1 - oldest_version(g)
        spanning += age
        assert age == (1 if any("default" in token_versions(s) for s in g) else 0)
    assert spanning >= 1 and m1["rollout/staleness_1"] == spanning
    # third take at version 2 with --max-staleness 1: a group with a version-0 token (age 2) is dropped
    for g in third:
        assert 2 - oldest_version(g) <= 1 and all(status(s) in (COMPLETED, TRUNCATED) for s in g)
    assert m2["rollout/staleness_max"] <= 1
    assert m2["rollout/stale_groups_dropped"] + len(third) >= 2
    assert m2["perf/trainer_wait_s"] >= 0 and m2["rollout/engine_idle_s"] >= 0
    assert fourth == [] and m3["rollout/stale_groups_dropped"] >= 1
    # every one of the 8 prompts became a group that was taken or dropped, none twice
    dropped = sum(m["rollout/stale_groups_dropped"] for m in (m0, m1, m2, m3))
    assert len(first) + len(second) + len(third) + dropped == len(rows)
