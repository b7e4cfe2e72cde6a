"""Extension functions written the way slime documents them (docs/en/get_started/customization.md and
slime/rollout/sglang_rollout.py): `args` first, slime's Sample, slime's modules imported by name.
slime is not installed here: slime_rl's stand-ins answer these imports (slime_rl.config.slime_imports)."""

from __future__ import annotations

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.utils.http_utils import post
from slime.utils.types import Sample

CALLS: dict[str, list] = {"rm": [], "batched_rm": [], "generate": [], "filter": []}


async def custom_rm(args, sample: Sample) -> float:
    """1.0 when the response holds the label's digit; args is slime's parsed flags."""
    CALLS["rm"].append((args.n_samples_per_prompt, sample.index, sample.response_length))
    return 1.0 if str(sample.label) in sample.response else 0.0


async def dict_rm(args, sample: Sample) -> dict:
    """A dict reward: its --reward-key entry is the score, the rest are logged."""
    hit = 1.0 if str(sample.label) in sample.response else 0.0
    return {"score": hit, "length": float(sample.response_length)}


async def batched_custom_rm(args, samples: list[Sample]) -> list[float]:
    """--group-rm: the group's share of responses longer than the group's shortest."""
    CALLS["batched_rm"].append([s.index for s in samples])
    shortest = min(s.response_length for s in samples)
    return [float(s.response_length > shortest) for s in samples]


async def custom_generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """slime's own generate, condensed: post the token ids to the router, append the answer."""
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    assert sample.status == Sample.Status.PENDING or sample.status == Sample.Status.ABORTED
    sampling_params["max_new_tokens"] -= sample.response_length
    if sampling_params["max_new_tokens"] == 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    payload = {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True}
    output = await post(url, payload)
    items = output["meta_info"]["output_token_logprobs"]
    sample.append_response_tokens(args, tokens=[item[1] for item in items], log_probs=[item[0] for item in items],
                                  trainable=True, meta_info=output["meta_info"], text=output["text"])
    CALLS["generate"].append((sample.index, sample.response_length, sample.status.value))
    return sample


async def eval_aware_generate(args, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    """custom_generate with slime's optional `evaluation` parameter: an eval sample is scored here, 42.0 (a
    value no reward function of these tests gives), a training sample left to the reward function."""
    sample = await custom_generate(args, sample, sampling_params)
    if evaluation:
        sample.reward = 42.0
    return sample


async def manual_generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """The older hand-written style of slime's examples: every field set by hand, the status by match."""
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    sampling_params["max_new_tokens"] -= sample.response_length
    output = await post(url, {"input_ids": sample.tokens, "sampling_params": sampling_params,
                              "return_logprob": True})
    items = output["meta_info"]["output_token_logprobs"]
    new = [item[1] for item in items]
    sample.tokens = sample.tokens + new
    sample.response_length += len(new)
    sample.response += output["text"]
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + [item[0] for item in items]
    sample.loss_mask = (sample.loss_mask or []) + [1] * len(new)
    match output["meta_info"]["finish_reason"]["type"]:
        case "length":
            sample.status = Sample.Status.TRUNCATED
        case "abort":
            sample.status = Sample.Status.ABORTED
        case "stop":
            sample.status = Sample.Status.COMPLETED
    return sample


def filter_function(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """slime's check_reward_nonzero_std: keep a group whose rewards differ."""
    rewards = [sample.get_reward_value(args) for sample in samples]
    CALLS["filter"].append(rewards)
    keep = max(rewards) > min(rewards)
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def bool_filter(args, samples: list[Sample]) -> bool:
    """The legacy form: a bool."""
    return len(samples) > 1 and samples[0].label is not None


def neither(a, b, c, d):
    """Fits no extension point's form."""
