"""A generate function (--custom-generate-function-path) for loop tests of over-sampling and partial
rollout: odd groups run their whole budget (ignore_eos), even groups stop after 4 tokens, so the even
groups fill the batch while the odd ones are still on the engine and get aborted."""

from __future__ import annotations

from typing import Any

from slime_rl.rollout.custom import generate_default


async def generate(sample: Any, sampling_params: dict[str, Any], client_pool: Any) -> Any:
    if sample.group_index % 2:
        sampling_params = {**sampling_params, "ignore_eos": True}
    else:
        sampling_params = {**sampling_params, "max_new_tokens": 4}
    return await generate_default(sample, sampling_params, client_pool)
