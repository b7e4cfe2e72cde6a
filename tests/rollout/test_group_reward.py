"""`--group-rm` in the rollout room: a group reward function sees each group once, complete, against a
real embedded engine, including a group cut by an abort and finished by partial rollout."""

from __future__ import annotations

import pytest
from rollout_testlib import feeder, row, slow_or_fast, start_server, with_clients

from slime_rl.data import Sample
from slime_rl.rewards import GroupReward
from slime_rl.rollout.dynamic import generate_filtered_groups
from slime_rl.rollout.options import RolloutOptions
from slime_rl.rollout.partial import ABORTED, is_done, status


@pytest.fixture(scope="module")
def server(tiny_qwen2):
    s = start_server(tiny_qwen2, random_seed=11, max_running_requests=32)
    yield s
    s.shutdown()


class RankReward:
    """Scores a sample by the rank of its response length inside its group: only computable with the
    whole group. Records every call (group index, sample indices, all done?)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, tuple[int, ...], bool]] = []

    def __call__(self, samples: list[Sample]) -> list[dict[str, float]]:
        self.calls.append((samples[0].group_index, tuple(s.index for s in samples), all(is_done(s) for s in samples)))
        return [{"score": float(sum(o.response_length < s.response_length for o in samples)), "len": s.response_length}
                for s in samples]


def expected_rank(group: list[Sample]) -> list[float]:
    lengths = [s.response_length for s in group]
    return [float(sorted(lengths).index(n)) for n in lengths]  # number of strictly shorter responses


def test_each_group_scored_once_when_complete(server):
    fn = RankReward()
    rows = [row(i, "x") for i in range(4)]
    next_rows, _ = feeder(rows)
    opts = RolloutOptions(rollout_batch_size=4, n_samples_per_prompt=3, max_response_len=12)
    res = with_clients([server.url], lambda cl: generate_filtered_groups(cl, next_rows, opts, GroupReward(fn),
                                                                         server.tokenizer))
    assert len(res.groups) == 4
    assert sorted(c[0] for c in fn.calls) == [g[0].group_index for g in res.groups]  # one call per group
    assert all(done for _, _, done in fn.calls) and all(len(ix) == 3 for _, ix, _ in fn.calls)
    for g in res.groups:
        assert [s.reward for s in g] == expected_rank(g)
        assert [s.reward_metrics["len"] for s in g] == [float(s.response_length) for s in g]


def test_cut_group_is_scored_after_partial_rollout_finishes_it(server):
    # step 1: two fast groups fill the batch while two slow ones are aborted; the group function must not
    # see the slow groups yet. step 2: the slow groups resume, finish, and are scored whole, once.
    fn = RankReward()
    rows = [row(1, "fast"), row(2, "slow"), row(3, "fast"), row(4, "slow")]
    next_rows, _ = feeder(rows)
    opts = RolloutOptions(rollout_batch_size=2, n_samples_per_prompt=2, max_response_len=4, over_sampling_batch_size=4,
                          partial_rollout=True)
    reward = GroupReward(fn)
    first = with_clients([server.url], lambda cl: generate_filtered_groups(cl, next_rows, opts, reward,
                                                                           server.tokenizer,
                                                                           generate_fn=slow_or_fast(400)))
    assert [g[0].label for g in first.groups] == ["fast", "fast"]
    assert [g[0].label for g in first.leftover] == ["slow", "slow"]
    assert {c[0] for c in fn.calls} == {g[0].group_index for g in first.groups}
    assert all(s.reward is None and status(s) == ABORTED for g in first.leftover for s in g)

    fn.calls.clear()
    more, _ = feeder([])
    second = with_clients([server.url], lambda cl: generate_filtered_groups(
        cl, more, opts, reward, server.tokenizer, resume=first.leftover, generate_fn=slow_or_fast(20)))
    assert [g[0].label for g in second.groups] == ["slow", "slow"]
    assert sorted(c[0] for c in fn.calls) == [g[0].group_index for g in second.groups]
    assert all(done for _, _, done in fn.calls)
    for g in second.groups:
        assert [s.reward for s in g] == expected_rank(g)
