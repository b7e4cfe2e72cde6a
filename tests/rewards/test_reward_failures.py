"""The reward failure policy: a raising reward scores --reward-failure-value, is counted, its first
traceback is printed once; a step where every sample failed stops with the traceback."""

from __future__ import annotations

import asyncio
import time

import pytest

from slime_rl.data import Sample
from slime_rl.rewards import RewardError, call_reward, make_reward_fn

PLUGINS = "tests.rewards.plugins.failing_rewards"


def samples(n: int, first: int = 0) -> list[Sample]:
    return [Sample(index=i, group_index=i // 4, prompt="p", prompt_ids=[1], response="r")
            for i in range(first, first + n)]


def score(fn, batch: list[Sample]) -> list[float]:
    async def main():
        return await asyncio.gather(*(call_reward(fn, s) for s in batch))
    return asyncio.run(main())


def test_failing_samples_score_the_failure_value_and_are_counted(capsys):
    fn = make_reward_fn(None, f"{PLUGINS}:flaky", failure_value=-0.5)
    batch = samples(20)
    mark = fn.failures.mark()
    rewards = score(fn, batch)
    expected = [-0.5 if s.index % 3 == 0 else 1.0 for s in batch]  # by hand: indices 0, 3, ..., 18 raise
    assert rewards == expected
    assert fn.failures.check_step(mark, step=0) == 7 and fn.failures.calls == 20
    err = capsys.readouterr().err
    assert err.count("raised; the sample scores -0.5") == 1  # the first traceback once, not 7 times
    assert "ZeroDivisionError: flaky on purpose" in err and "Traceback" in err
    score(fn, samples(6, first=20))  # later failures: counted, not printed again
    assert fn.failures.failures == 9 and "raised" not in capsys.readouterr().err


def test_every_sample_of_a_step_failing_stops_with_the_traceback():
    fn = make_reward_fn(None, f"{PLUGINS}:always_broken", failure_value=0.0)
    mark = fn.failures.mark()
    assert score(fn, samples(8)) == [0.0] * 8
    with pytest.raises(RewardError, match="raised on every one of the step's 8 samples") as info:
        fn.failures.check_step(mark, step=3)
    assert "step 3" in str(info.value) and "KeyError: 'broken reward'" in str(info.value)


def test_a_step_with_one_success_goes_on():
    fn = make_reward_fn(None, f"{PLUGINS}:flaky", failure_value=0.0)
    mark = fn.failures.mark()
    score(fn, samples(1, first=0) + samples(1, first=3) + samples(1, first=4))  # 0 and 3 raise, 4 does not
    assert fn.failures.check_step(mark, step=0) == 2


def test_without_a_failure_value_the_exception_propagates():
    fn = make_reward_fn(None, f"{PLUGINS}:flaky")
    with pytest.raises(ZeroDivisionError):
        score(fn, samples(1))


def test_group_reward_failure_fails_its_whole_group():
    fn = make_reward_fn(None, f"{PLUGINS}:group_flaky", group_rm=True, failure_value=-1.0)
    groups = [samples(4, first=4 * g) for g in range(5)]  # groups 0..4: indices 0-3, 4-7, ... 16-19
    mark = fn.failures.mark()

    async def main():
        return await asyncio.gather(*(fn(g) for g in groups))

    results = asyncio.run(main())
    # by hand: a group fails when it holds a multiple of 5: 0 (g0), 5 (g1), 10 (g2), 15 (g3); g4 = 16..19 passes
    assert [[score for score, _ in r] for r in results] == [[-1.0] * 4] * 4 + [[1.0] * 4]
    assert fn.failures.check_step(mark, step=0) == 16 and fn.failures.calls == 20
    with pytest.raises(ValueError, match="broken on purpose"):
        asyncio.run(make_reward_fn(None, f"{PLUGINS}:group_flaky", group_rm=True)(groups[0]))


@pytest.mark.parametrize("name", ["hangs_on_odd", "async_hangs_on_odd"])
def test_a_reward_that_never_returns_scores_the_failure_value_after_the_timeout(name, capsys):
    """A sync reward hung in its thread or an async one hung on the loop: past --reward-timeout-s the
    sample scores the failure value and is counted as a timeout; the others score normally, and more
    hung calls than threads at once (40 > 32) still all finish."""
    fn = make_reward_fn(None, f"{PLUGINS}:{name}", failure_value=-1.0, timeout_s=0.5)
    batch = samples(80)
    mark = fn.failures.mark()
    t0 = time.monotonic()
    rewards = score(fn, batch)
    took = time.monotonic() - t0
    assert rewards == [-1.0 if s.index % 2 else 1.0 for s in batch]  # by hand: the odd ones hang
    assert fn.failures.check_step(mark, step=0) == 40 and fn.failures.timeouts_since(mark) == 40
    assert took < 10, took  # two rounds of 32 slots at most, not a hang
    err = capsys.readouterr().err
    assert err.count("did not return within 0.5 s (--reward-timeout-s)") == 1 and "Traceback" not in err


def test_a_group_reward_that_never_returns_fails_its_group_only():
    fn = make_reward_fn(None, f"{PLUGINS}:group_hangs_on_first", group_rm=True, failure_value=-1.0, timeout_s=0.5)
    groups = [samples(4, first=4 * g) for g in range(3)]
    mark = fn.failures.mark()

    async def main():
        return await asyncio.gather(*(fn(g) for g in groups))

    results = asyncio.run(main())
    assert [[s for s, _ in r] for r in results] == [[-1.0] * 4, [1.0] * 4, [1.0] * 4]
    assert fn.failures.timeouts_since(mark) == 4


def test_every_sample_timing_out_stops_the_step_saying_so():
    fn = make_reward_fn(None, f"{PLUGINS}:hangs_on_odd", failure_value=0.0, timeout_s=0.2)
    mark = fn.failures.mark()
    assert score(fn, samples(3, first=1)[::2]) == [0.0, 0.0]  # indices 1 and 3
    with pytest.raises(RewardError, match="timed out on every one of the step's 2 samples"):
        fn.failures.check_step(mark, step=5)


def test_a_generate_function_that_scores_its_samples_needs_no_reward_flag(tmp_path, capsys):
    """slime's agent examples set sample.reward in their --custom-generate-function-path and pass no reward
    flag: the run takes those rewards (the reward function is not called for a scored sample) and a sample left
    unscored is a failure naming why; without a generate function, no reward flag is still a refusal."""
    from slime_rl.config import ConfigError, build_config
    from slime_rl.data.sample import ROLLOUT_STATUS_KEY
    from slime_rl.rollout.generate import _after_generate

    fn = make_reward_fn(None, None, failure_value=0.0, generate_sets_reward=True)
    scored, unscored = samples(2)
    scored.reward = 0.75
    for s in (scored, unscored):
        s.metadata[ROLLOUT_STATUS_KEY] = "completed"
    assert asyncio.run(_after_generate(scored, True, fn)).reward == 0.75 and fn.failures.calls == 0
    assert asyncio.run(_after_generate(unscored, True, fn)).reward == 0.0 and fn.failures.failures == 1
    assert "sample 1: --custom-generate-function-path left its reward unset" in capsys.readouterr().err
    strict = make_reward_fn(None, None, generate_sets_reward=True)
    with pytest.raises(RewardError, match="no --rm-type or --custom-rm-path is given to score it"):
        score(strict, samples(1))
    with pytest.raises(RewardError, match="no reward: set --rm-type or --custom-rm-path"):
        make_reward_fn(None, None)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "d.jsonl").write_text('{"input": "1", "label": "1"}\n')
    base = ["--hf-checkpoint", str(tmp_path / "m"), "--prompt-data", str(tmp_path / "d.jsonl"),
            "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--num-rollout", "1"]
    agent = ["--custom-generate-function-path", "tests.plugins.slime_style.custom_generate"]
    assert build_config(base + agent).rollout.custom_generate_function_path == agent[1]
    with pytest.raises(ConfigError,
                       match="or a --custom-generate-function-path or --agent-env that sets each sample's reward"):
        build_config(base)
    # eval samples come from the same generate function (as slime's eval), which scores them too
    cfg = build_config(base + agent + ["--eval-prompt-data", "x", str(tmp_path / "d.jsonl"), "--eval-interval", "1"])
    assert cfg.eval.datasets == (("x", str(tmp_path / "d.jsonl")),)
