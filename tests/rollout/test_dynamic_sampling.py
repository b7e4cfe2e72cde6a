"""Dynamic sampling / over-sampling against a real embedded engine: prompts drawn in batches until
exactly rollout_batch_size groups pass the filter, the rest aborted by the exact rids of their
requests in flight (SGLang drops any other rid) without touching anyone else's requests."""

from __future__ import annotations

import asyncio
import random

import pytest
from rollout_testlib import feeder, row, slow_or_fast, start_server, with_clients

from slime_rl.config import RolloutConfig
from slime_rl.data import Sample
from slime_rl.rollout.custom import load_filter
from slime_rl.rollout.dynamic import generate_filtered_groups
from slime_rl.rollout.filters import check_reward_nonzero_std
from slime_rl.rollout.generate import generate_groups
from slime_rl.rollout.options import RolloutOptions
from slime_rl.rollout.partial import ABORTED, COMPLETED, TRUNCATED, status
from slime_rl.rollout.routing import ClientPool, request_id

FILTER = "slime_rl.rollout.filters.check_reward_nonzero_std"


@pytest.fixture(scope="module")
def server(tiny_qwen2):
    s = start_server(tiny_qwen2, random_seed=7, max_running_requests=32)
    yield s
    s.shutdown()


def reward(sample: Sample) -> float:
    """'same' prompts always score 1 (zero std: filtered); 'random' ones a seeded uniform (non-zero std)."""
    return 1.0 if sample.label == "same" else random.Random(sample.index).random()


class HeldClient:
    """A client whose /generate waits until released, recording every abort it is sent."""

    def __init__(self) -> None:
        self.aborts: list[str] = []
        self.sent: list[str] = []
        self.release = asyncio.Event()

    async def generate(self, *, rid: str, **_kw) -> dict:
        self.sent.append(rid)
        await self.release.wait()
        return {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}, "output_token_logprobs": []}}

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborts.append(rid)


def test_abort_groups_names_each_live_rid_exactly():
    # SGLang 0.5.23 drops an abort whose rid is not a live rid, so a group is aborted rid by rid
    async def go():
        engines = [HeldClient(), HeldClient()]
        pool = ClientPool(engines, tokenizer=None, per_engine=4)
        samples = [Sample(index=i, group_index=g, prompt="", prompt_ids=[1]) for g, i in ((3, 0), (3, 1), (30, 2))]
        tasks = [asyncio.create_task(pool.generate(s, [1], {})) for s in samples]
        while sum(len(e.sent) for e in engines) < 3:
            await asyncio.sleep(0)
        assert await pool.abort_groups([3]) == 2
        group3 = sorted(r for e in engines for r in e.sent if "-g0000000003-" in r)
        assert sorted(r for e in engines for r in e.aborts) == group3 and len(set(group3)) == 2
        for e in engines:  # each abort went to the engine that holds that rid
            assert set(e.aborts) <= set(e.sent)
        for e in engines:
            e.release.set()
        await asyncio.gather(*tasks)
        assert pool.live_rids(3) == {} and pool.live_rids(30) == {}
        assert await pool.abort_groups([3, 30]) == 0  # nothing in flight: nothing to abort

    asyncio.run(go())
    # SGLang's scheduler aborts by prefix once the tokenizer manager forwards a rid: none may start another
    rids = [request_id("ab12", g, s, n) for g in (1, 10) for s in (2, 20) for n in (1, 12, 123)]
    assert len(set(rids)) == len(rids)
    assert not any(a != b and b.startswith(a) for a in rids for b in rids)


def test_nonzero_std_filter_on_hand_made_groups():
    def group(*rewards):
        return [Sample(index=i, group_index=3, prompt="", prompt_ids=[1], reward=r) for i, r in enumerate(rewards)]

    assert check_reward_nonzero_std(group(0.0, 1.0, 1.0)) is True
    assert check_reward_nonzero_std(group(0.5, 0.5)) is False
    assert check_reward_nonzero_std(group(1.0)) is False  # one sample has no spread
    with pytest.raises(ValueError, match="group 3 has unscored"):
        check_reward_nonzero_std(group(1.0, None))
    assert load_filter(FILTER) is check_reward_nonzero_std and load_filter(None) is None


def test_keeps_exactly_batch_size_nonzero_std_groups(server):
    # Batches of 4 alternate same/random. Random groups are either kept or still running, so after the
    # second draw kept + running >= 3 always: exactly 8 prompts are drawn, and the first draw cannot be
    # topped up before both of its 'same' groups were filtered (4 - filtered < 3).
    rows = [row(i, "same" if i % 2 == 0 else "random") for i in range(16)]
    next_rows, asked = feeder(rows)
    opts = RolloutOptions(rollout_batch_size=3, n_samples_per_prompt=2, max_response_len=6,
                          over_sampling_batch_size=4, dynamic_sampling_filter_path=FILTER)
    res = with_clients([server.url], lambda cl: generate_filtered_groups(cl, next_rows, opts, reward, server.tokenizer,
                                                                         first_index=100, first_group=50))
    assert len(res.groups) == 3
    for g in res.groups:
        assert len(g) == 2 and {s.label for s in g} == {"random"}
        assert max(s.reward for s in g) > min(s.reward for s in g)
        # done: stopped by EOS (completed) or by the 6-token budget (truncated)
        assert all(status(s) == (TRUNCATED if s.finish_reason == "length" else COMPLETED) for s in g)
        assert all(0 < s.response_length <= 6 and s.finish_reason in ("stop", "length") for s in g)
    m = res.metrics
    assert asked == [4, 4] and m["rollout/prompts_drawn"] == 8
    # the filtered 'same' groups (reward 1) count in the pre-filter mean, not in the kept groups'
    kept = [s.reward for g in res.groups for s in g]
    assert m["rollout/groups_filtered"] >= 1 and m["rollout/reward_mean_before_filter"] > sum(kept) / len(kept)
    assert m["rollout/groups_filtered"] >= 2
    assert 3 + m["rollout/groups_filtered"] + m["rollout/groups_aborted"] + m["rollout/groups_surplus"] == 8
    assert res.leftover == []  # no partial rollout: cut groups are dropped, only counted
    assert (res.next_index, res.next_group) == (100 + 16, 50 + 8)
    assert m["rollout/engine0_requests"] <= 16 and res.counters[0]["in_flight"] == 0


def test_aborts_the_rest_by_group_and_keeps_partials(server):
    # Two fast groups pass the filter while two slow ones (400 tokens) still run: the slow ones are
    # aborted and, under partial rollout, come back with their tokens so far. A second rollout sharing
    # the engine (its own nonce) runs through the abort untouched.
    rows = [row(1, "random"), row(2, "slow"), row(3, "random"), row(4, "slow")]
    next_rows, _ = feeder(rows)
    opts = RolloutOptions(rollout_batch_size=2, n_samples_per_prompt=2, max_response_len=4, over_sampling_batch_size=4,
                          dynamic_sampling_filter_path=FILTER, partial_rollout=True)
    other_cfg = RolloutConfig(n_samples_per_prompt=2, max_response_len=60)
    aborted_before = server.engine.stats["requests_aborted"]

    async def both(clients):
        other = asyncio.create_task(generate_groups(clients, [row(9, "x")], other_cfg, lambda s: 0.0,
                                                    server.tokenizer, progress=False,
                                                    options=RolloutOptions.from_config(
                                                        other_cfg, extra_sampling_params={"ignore_eos": True})))
        res = await generate_filtered_groups(clients, next_rows, opts, reward, server.tokenizer,
                                             generate_fn=slow_or_fast(400))
        return res, await other

    res, other = with_clients([server.url], both)
    assert [g[0].label for g in res.groups] == ["random", "random"]
    assert [g[0].label for g in res.leftover] == ["slow", "slow"]
    m = res.metrics
    assert m["rollout/groups_aborted"] == 2 and m["rollout/groups_leftover"] == 2 and m["rollout/abort_requests"] >= 2
    for g in res.leftover:
        for s in g:
            assert status(s) == ABORTED and s.finish_reason == "abort" and s.reward is None
            assert s.response_length < 400
            assert len(s.rollout_logprobs) == len(s.loss_mask) == s.response_length
    aborted_now = server.engine.stats["requests_aborted"] - aborted_before
    assert 1 <= aborted_now <= 4  # the slow samples that had reached the engine, nothing else
    assert [s.finish_reason for s in other[0]] == ["length", "length"]
    assert [s.response_length for s in other[0]] == [60, 60]
