"""Reward functions written the slime way (`async def rm(args, sample)`, `--group-rm`'s
`rm(args, samples)`) and EasyR1 reward files (REWARD_TYPE batch / sequential, compute_score over
dicts with response / response_length / ground_truth, "overall"), loaded by --custom-rm-path and
scored through make_reward_fn. Expected scores are worked out by hand from each file's rule."""

from __future__ import annotations

import argparse
import asyncio
import importlib
from pathlib import Path

import pytest

from slime_rl.config import slime_imports
from slime_rl.data import Sample
from slime_rl.rewards import GroupReward, RewardError, make_reward_fn, score_samples

slime_imports.install()  # what loading by --custom-rm-path does first; the test imports the file itself
slime_style = importlib.import_module("tests.plugins.slime_style")

EASYR1 = Path(__file__).resolve().parents[1] / "config" / "easyr1"
ARGS = argparse.Namespace(n_samples_per_prompt=4, reward_key=None)


def sample(response: str, label: str = "3", index: int = 0, n_tokens: int = 5) -> Sample:
    return Sample(index=index, group_index=7, prompt="p", prompt_ids=[1, 2], label=label, response=response,
                  response_ids=list(range(10, 10 + n_tokens)), rollout_logprobs=[-0.5] * n_tokens,
                  loss_mask=[1] * n_tokens, finish_reason="stop", metadata={"rollout_status": "completed", "k": 1})


def score(fn, samples):
    return asyncio.run(score_samples(fn, samples))


def test_slime_rm_gets_args_and_slime_sample():
    slime_style.CALLS["rm"].clear()
    fn = make_reward_fn(None, "tests.plugins.slime_style:custom_rm", args=ARGS)
    assert score(fn, [sample("it is 3", index=0, n_tokens=4), sample("it is 4", index=1)]) == [1.0, 0.0]
    # slime's Sample: response_length is the number of response tokens; args are the ones given
    assert sorted(slime_style.CALLS["rm"]) == [(4, 0, 4), (4, 1, 5)]


def test_slime_rm_from_a_file_path_and_a_dict_result():
    path = f"{Path(slime_style.__file__)}:dict_rm"
    fn = make_reward_fn(None, path, args=ARGS)
    s = sample("3!", n_tokens=6)
    assert score(fn, [s]) == [1.0] and s.reward_metrics == {"length": 6.0}


def test_slime_group_rm():
    slime_style.CALLS["batched_rm"].clear()
    fn = make_reward_fn(None, "tests.plugins.slime_style:batched_custom_rm", group_rm=True, args=ARGS)
    assert isinstance(fn, GroupReward)
    group = [sample("a", index=i, n_tokens=n) for i, n in enumerate([3, 5, 3, 4])]
    assert score(fn, group) == [0.0, 1.0, 0.0, 1.0]  # longer than the shortest (3 tokens)
    assert slime_style.CALLS["batched_rm"] == [[0, 1, 2, 3]]


def test_easyr1_batch_file_scores_a_group_per_call():
    fn = make_reward_fn(None, f"{EASYR1 / 'math_reward.py'}:compute_score")
    assert isinstance(fn, GroupReward) and fn.reward_key == "overall"
    group = [sample("<think>so</think> \\boxed{3}"), sample("\\boxed{4}"), sample("the answer 3"), sample("none")]
    # overall = 0.9 accuracy + 0.1 format: both / neither / accuracy only (last digit) / neither
    assert score(fn, group) == pytest.approx([1.0, 0.0, 0.9, 0.0])
    assert group[0].reward_metrics == {"format": 1.0, "accuracy": 1.0}
    assert group[2].reward_metrics == {"format": 0.0, "accuracy": 1.0}


def test_easyr1_file_graded_with_mathruler(monkeypatch):
    """An EasyR1 reward file that grades with mathruler (the `easyr1` extra) loads and scores: \\frac{1}{2}
    equals the label 0.5 by mathruler's grader; without mathruler the load names the extra that installs it."""
    path = f"{EASYR1 / 'mathruler_reward.py'}:compute_score"
    fn = make_reward_fn(None, path)
    group = [sample("<think>a</think> \\boxed{\\frac{1}{2}}", label="0.5"), sample("\\boxed{2}", label="0.5")]
    assert score(fn, group) == pytest.approx([1.0, 0.0])
    import sys

    monkeypatch.setitem(sys.modules, "mathruler", None)
    monkeypatch.setitem(sys.modules, "mathruler.grader", None)
    for name in [n for n in sys.modules if n.startswith("slime_rl_user_mathruler_reward")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(RewardError, match=r"importing .*mathruler_reward.py failed: ModuleNotFoundError: .*mathruler"
                                          r".*\(pip install 'slime-rl\[easyr1\]' installs it\)"):
        make_reward_fn(None, path)


def test_easyr1_reward_kwargs():
    fn = make_reward_fn(None, f"{EASYR1 / 'math_reward.py'}:compute_score", rm_kwargs='{"format_weight": 0.5}')
    assert score(fn, [sample("\\boxed{3}"), sample("<think>a</think>\\boxed{2}")]) == pytest.approx([0.5, 0.5])
    with pytest.raises(RewardError, match="--custom-rm-kwargs .*does not take them"):
        make_reward_fn(None, f"{EASYR1 / 'math_reward.py'}:compute_score", rm_kwargs='{"weight": 1}')
    with pytest.raises(RewardError, match="--custom-rm-kwargs .*JSON object"):
        make_reward_fn(None, f"{EASYR1 / 'math_reward.py'}:compute_score", rm_kwargs="[1]")


def test_easyr1_reward_with_required_keyword_arguments():
    """DAPO's shape (EasyR1's examples/reward_function/dapo.py): compute_score(reward_inputs, max_response_length,
    overlong_buffer_length, overlong_penalty_factor), the three bound from --custom-rm-kwargs as EasyR1 binds them.
    By hand, max 10 tokens with a buffer of 4: 5 tokens score no penalty; 8 tokens (8 - 6) / 4 = 0.5 over, so
    -0.5 x factor 2 = -1; 12 tokens beyond the maximum -1 x 2 = -2; a right answer +1, a wrong one -1."""
    path = f"{EASYR1 / 'dapo_reward.py'}:compute_score"
    fn = make_reward_fn(None, path, rm_kwargs='{"max_response_length": 10, "overlong_buffer_length": 4, '
                                              '"overlong_penalty_factor": 2.0}')
    group = [sample("Answer: 3", n_tokens=5), sample("x\nAnswer: 3", n_tokens=8), sample("Answer: 4", n_tokens=12)]
    assert score(fn, group) == pytest.approx([1.0, 1.0 - 1.0, -1.0 - 2.0])
    with pytest.raises(RewardError, match=r"dapo_reward.py:compute_score'.*fits no supported form"):
        make_reward_fn(None, path)  # without the three arguments there is no call to make
    with pytest.raises(RewardError, match="fits no supported form"):
        make_reward_fn(None, path, rm_kwargs='{"max_response_length": 10}')


def test_easyr1_sequential_file_scores_one_sample_per_call():
    fn = make_reward_fn(None, f"{EASYR1 / 'r1v_reward.py'}:compute_score")
    assert not isinstance(fn, GroupReward)
    a, b = sample("<answer>3</answer>", n_tokens=7), sample("<answer>5</answer>")
    # overall = 0.5 accuracy + 0.5 format
    assert score(fn, [a, b]) == [1.0, 0.5]
    assert a.reward_metrics == {"format": 1.0, "accuracy": 1.0, "length": 7.0}  # response_length in tokens
    plain = make_reward_fn(None, f"{EASYR1 / 'r1v_reward.py'}:plain")  # a float result works too
    assert score(plain, [sample("3"), sample("4")]) == [1.0, 0.0]


def test_easyr1_ground_truth_is_text():
    seen = []

    def compute_score(reward_input):
        seen.append(reward_input)
        return 0.0
    import types
    module = types.ModuleType("easyr1_probe")
    module.REWARD_TYPE, module.compute_score = "sequential", compute_score
    compute_score.__module__ = "easyr1_probe"
    import sys
    sys.modules["easyr1_probe"] = module
    try:
        fn = make_reward_fn(None, "easyr1_probe:compute_score")
        score(fn, [sample("r", label=12, n_tokens=3)])
    finally:
        del sys.modules["easyr1_probe"]
    assert seen == [{"response": "r", "response_length": 3, "ground_truth": "12"}]


def test_bad_reward_type_and_unfit_signatures_name_the_flag(tmp_path):
    bad = tmp_path / "bad_type.py"
    bad.write_text('REWARD_TYPE = "pairwise"\ndef compute_score(x):\n    return 0.0\n')
    with pytest.raises(RewardError, match="--custom-rm-path .*REWARD_TYPE 'pairwise'"):
        make_reward_fn(None, f"{bad}:compute_score")
    with pytest.raises(RewardError, match=r"--custom-rm-path .*neither\(a, b, c, d\) fits no supported form; "
                                          r"expected `rm\(sample\)` \(ours\) or `async rm\(args, sample\)` \(slime\)"):
        make_reward_fn(None, "tests.plugins.slime_style:neither")
    with pytest.raises(RewardError, match=r"rm\(samples\)"):
        make_reward_fn(None, "tests.plugins.slime_style:neither", group_rm=True)


def test_our_own_form_is_unchanged():
    fn = make_reward_fn(None, "tests.plugins.example_reward:length_reward")  # (sample): ours, our Sample
    assert score(fn, [sample("abcd")]) == [4.0]
