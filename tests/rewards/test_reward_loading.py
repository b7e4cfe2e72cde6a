"""Custom rewards by path (dotted and file), dict rewards and their metrics, group rewards,
per-sample rm_type, and sync rewards running off the event loop."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from slime_rl.config.dotted_path import load_by_path
from slime_rl.data import Sample
from slime_rl.rewards import (
    GroupReward,
    RewardError,
    RewardResult,
    call_reward,
    call_reward_full,
    load_reward,
    make_reward_fn,
    reward_metric_means,
    score_samples,
)
from tests.rewards.plugins import custom_rewards

PLUGINS = "tests.rewards.plugins"
EASYR1_FILE = Path(__file__).parent / "plugins" / "easyr1_reward.py"
GOOD = "<think>3*4=12</think> \\boxed{12}"


def sample(response: str, label: object = "12", index: int = 0, **metadata) -> Sample:
    return Sample(index=index, group_index=0, prompt="p", prompt_ids=[1], label=label, response=response,
                  metadata=metadata)


def run(coro):
    return asyncio.run(coro)


def test_dict_reward_score_and_logged_extras():
    fn = load_by_path(f"{PLUGINS}.custom_rewards:dict_reward", "--custom-rm-path")
    score, metrics = run(call_reward_full(fn, sample("abc")))
    assert score == 0.25
    assert metrics == {"length": 3.0, "passed": 1.0}  # "note" is not a number, so not a metric
    s = sample("abcd")
    assert run(call_reward(fn, s)) == 0.25  # the rollout path: float back, extras on the sample
    assert s.reward_metrics == {"length": 4.0, "passed": 1.0}


@pytest.mark.parametrize("path", [f"{PLUGINS}.easyr1_reward:compute_score", f"{EASYR1_FILE}:compute_score",
                                  "tests/rewards/plugins/easyr1_reward.py:compute_score"])
def test_easyr1_file_loads_by_path_with_reward_key_overall(path):
    fn = make_reward_fn(None, path, reward_key="overall")
    score, metrics = run(call_reward_full(fn, sample(GOOD)))
    assert score == pytest.approx(1.0) and metrics == {"format": 1.0, "accuracy": 1.0}
    score, metrics = run(call_reward_full(fn, sample("\\boxed{12}")))  # right answer, no think block
    assert score == pytest.approx(0.9) and metrics == {"format": 0.0, "accuracy": 1.0}
    assert run(call_reward(fn, sample("<think>x</think> \\boxed{11}"))) == pytest.approx(0.1)


def test_reward_key_mismatch_names_the_flag():
    fn = load_by_path(f"{PLUGINS}.easyr1_reward:compute_score", "--custom-rm-path")
    with pytest.raises(RewardError, match=r"without the key 'score' \(--reward-key\); keys: \['accuracy'"):
        run(call_reward_full(fn, sample(GOOD)))
    with pytest.raises(RewardError, match="must be finite"):
        run(call_reward(custom_rewards.nan_reward, sample("x")))


def test_group_reward_sync_and_async():
    group = [sample("aa", index=0), sample("aaaa", index=1), sample("a", index=2)]
    rm = make_reward_fn(None, f"{PLUGINS}.custom_rewards:async_group_reward", group_rm=True)
    assert isinstance(rm, GroupReward)
    assert run(score_samples(rm, group)) == [0.0, 1.0, 0.0]
    assert [s.reward for s in group] == [0.0, 1.0, 0.0]
    batch = make_reward_fn(None, f"{EASYR1_FILE}:compute_score_batch", reward_key="overall", group_rm=True)
    pair = [sample(GOOD), sample("\\boxed{12}")]
    assert run(score_samples(batch, pair)) == pytest.approx([1.0, 0.9])
    assert pair[1].reward_metrics == {"format": 0.0, "accuracy": 1.0}
    assert reward_metric_means(pair) == {"rollout/reward/accuracy": 1.0, "rollout/reward/format": 0.5}
    bad = make_reward_fn(None, f"{PLUGINS}.custom_rewards:wrong_length_group_reward", group_rm=True)
    with pytest.raises(RewardError, match="must return a list of 2 rewards, one per sample; got 1 results"):
        run(score_samples(bad, pair))
    with pytest.raises(RewardError, match="--group-rm needs --custom-rm-path"):
        make_reward_fn("math", None, group_rm=True)


def test_per_sample_rm_type_overrides_the_default():
    fn = make_reward_fn("math", None)
    samples = [sample("\\boxed{12}"),                                # math: 1
               sample("twelve apples", label="twelve", rm_type="f1"),  # f1: P 1/2, R 1 -> 2/3
               sample("\\boxed{13}", rm_type="dapo"),                 # dapo: -1 and acc 0
               sample("no think", rm_type="format")]                 # format: 0
    scores = run(score_samples(fn, samples))
    assert scores == pytest.approx([1.0, 2 / 3, -1.0, 0.0])
    assert samples[2].reward_metrics == {"acc": 0.0} and samples[0].reward_metrics == {}
    assert isinstance(run(fn(samples[0])), RewardResult)
    with pytest.raises(RewardError, match=r"sample 7: metadata\['rm_type'\] 'nope': unknown reward type"):
        run(call_reward(fn, sample("x", index=7, rm_type="nope")))
    with pytest.raises(RewardError, match=r"metadata\['rm_type'\] 'remote_rm' needs --rm-url"):
        run(call_reward(fn, sample("x", rm_type="remote_rm")))


def test_flag_errors_are_raised_when_building():
    with pytest.raises(RewardError, match="--rm-type 'nope': unknown"):
        make_reward_fn("nope", None)
    with pytest.raises(RewardError, match="--rm-type 'remote_rm' needs --rm-url"):
        make_reward_fn("remote_rm", None)
    with pytest.raises(RewardError, match="set --rm-type or --custom-rm-path"):
        make_reward_fn(None, None)
    with pytest.raises(RewardError, match="--custom-rm-path .*no such file"):
        make_reward_fn(None, "tests/rewards/plugins/missing.py:f")
    with pytest.raises(RewardError, match="--custom-rm-path .*has no function 'nope'"):
        load_reward(None, f"{EASYR1_FILE}:nope")
    with pytest.raises(RewardError, match="remote_rm needs --rm-url"):
        load_reward("remote_rm", None)
    assert load_reward("math", None)(sample("\\boxed{12}")) == 1.0


def test_sync_rewards_run_in_threads_and_do_not_block_the_loop():
    """Four 0.2 s sync rewards finish together in well under 0.8 s, and a loop ticker keeps ticking."""
    custom_rewards.CALLS.clear()
    fn = make_reward_fn(None, f"{PLUGINS}.custom_rewards:slow_sync_reward")

    async def main() -> tuple[float, int]:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.create_task(ticker())
        start = time.monotonic()
        await score_samples(fn, [sample(str(i), index=i) for i in range(4)])
        elapsed = time.monotonic() - start
        done.set()
        await task
        return elapsed, ticks

    elapsed, ticks = run(main())
    assert elapsed < 0.6  # run inline, 4 x 0.2 s would take 0.8 s at least
    assert ticks >= 5  # the loop ran other work while the rewards slept
    assert len(custom_rewards.CALLS) == 4
    assert threading.main_thread().name not in custom_rewards.CALLS
