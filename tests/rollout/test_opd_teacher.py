"""--opd-type sglang: the teacher of on-policy distillation is its own server (slime's examples/on_policy_distillation
with SGLang; here the built-in engine serving another tiny model). Each scored sample carries the teacher's
log-prob of each response token, checked against a float64 forward of the teacher's model; slime's reward function
and post-process (the teacher call, every reward 0.0) map onto it; a teacher that fails fails its sample alone,
which then is not trained."""

from __future__ import annotations

import asyncio

import pytest
from rollout_testlib import float64_model, reference_logprobs, start_server

from slime_rl.config.flags_from_slime import SLIME_OPD_REWARD
from slime_rl.data import Sample
from slime_rl.rewards.loader import make_reward_fn
from slime_rl.rewards.teacher import TeacherError, response_logprobs


@pytest.fixture(scope="module")
def teacher(tiny_llama):
    server = start_server(tiny_llama, random_seed=3)
    yield server
    server.shutdown()


def _sample(i: int, prompt: list[int], response: list[int]) -> Sample:
    return Sample(index=i, group_index=i, prompt="p", prompt_ids=prompt, label="1", response="r",
                  response_ids=response, rollout_logprobs=[-1.0] * len(response), loss_mask=[1] * len(response))


def test_each_sample_gets_the_teachers_logprobs_and_slimes_reward_of_zero(teacher, tiny_llama):
    url = teacher.url + "/generate"
    reward = make_reward_fn(None, SLIME_OPD_REWARD, url, opd_teacher_url=url, opd_temperature=1.0)
    samples = [_sample(0, [5, 9, 12], [7, 3, 3, 20]), _sample(1, [40, 2], [11])]

    async def both():
        return await asyncio.gather(*(reward(s) for s in samples))

    results = asyncio.run(both())
    assert [r.score for r in results] == [0.0, 0.0]  # slime's post_process_rewards: distillation alone
    model = float64_model(tiny_llama)
    for s in samples:
        want = reference_logprobs(model, s.prompt_ids, s.response_ids)
        assert s.teacher_logprobs == pytest.approx(want.tolist(), abs=1e-5)
    # at another temperature the teacher scores the scaled distribution, as slime asks SGLang for it
    hot = make_reward_fn("digit", None, opd_teacher_url=teacher.url + "/generate", opd_temperature=0.5)
    sample = _sample(2, [5, 9, 12], [7, 3, 3, 20])
    asyncio.run(hot(sample))
    want = reference_logprobs(model, sample.prompt_ids, sample.response_ids, temperature=0.5)
    assert sample.teacher_logprobs == pytest.approx(want.tolist(), abs=1e-5)


def test_a_failing_teacher_fails_its_sample_alone_and_that_sample_is_not_trained(teacher):
    from slime_rl.config.groups import AlgoConfig
    from slime_rl.orchestration.rollout_manager import samples_to_batch

    down = make_reward_fn("digit", None, opd_teacher_url="http://127.0.0.1:9/generate", failure_value=0.0,
                          rm_timeout_s=5.0)
    up = make_reward_fn("digit", None, opd_teacher_url=teacher.url + "/generate", failure_value=0.0)
    good, bad = _sample(0, [5, 9], [7, 3]), _sample(1, [5, 9], [7, 4])
    asyncio.run(up(good))
    assert asyncio.run(down(bad)).score == 0.0 and down.failures.failures == 1
    assert bad.teacher_logprobs is None and len(good.teacher_logprobs) == 2
    for s in (good, bad):
        s.reward = 1.0
    batch = samples_to_batch([[good, bad]], AlgoConfig(use_opd=True, opd_type="sglang"))
    assert batch["teacher_logprobs"] == [good.teacher_logprobs, [0.0, 0.0]]
    assert batch["loss_masks"] == [[1, 1], [0, 0]]


def test_a_teacher_answer_that_is_not_the_samples_tokens_is_refused():
    sample = _sample(0, [5, 9], [7, 3])
    answer = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-1.0, 9, None], [-0.5, 7, None],
                                                     [-0.25, 3, None]]}}
    assert response_logprobs(answer, sample, "t") == [-0.5, -0.25]
    with pytest.raises(TeacherError, match="other token ids than the sample's response"):
        response_logprobs({"meta_info": {"input_token_logprobs": answer["meta_info"]["input_token_logprobs"][:3]
                                         + [[-0.25, 4, None]]}}, sample, "t")
    with pytest.raises(TeacherError, match="3 input_token_logprobs for a sample of 4 tokens"):
        response_logprobs({"meta_info": {"input_token_logprobs": answer["meta_info"]["input_token_logprobs"][1:]}},
                          sample, "t")
