"""Group generation: each prompt sent `n_samples_per_prompt` times to the engines, every finished
sample scored as soon as it finishes, groups returned in prompt order.

Requests are spread over the engines by in-flight load (the least busy engine gets the next
request), so one slow engine does not hold the step.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from slime_rl.config import RolloutConfig
from slime_rl.data import PromptRow, Sample
from slime_rl.rewards import RewardFn, call_reward
from slime_rl.rollout.client import AsyncEngineClient


@dataclass
class EngineEndpoint:
    url: str
    api_key: str | None = None


class LoadBalancer:
    """Least-in-flight routing over engine clients, at most `per_engine` requests in flight on each
    (the rest wait here, not in the server's accept queue); counts requests per engine."""

    def __init__(self, clients: Sequence[AsyncEngineClient], per_engine: int = 64) -> None:
        if not clients:
            raise ValueError("no rollout engines")
        self.clients = list(clients)
        self.in_flight = [0] * len(clients)
        self.sent = [0] * len(clients)
        self._slots = asyncio.Semaphore(per_engine * len(clients))

    async def acquire(self) -> int:
        await self._slots.acquire()
        i = min(range(len(self.clients)), key=lambda k: (self.in_flight[k], self.sent[k]))
        self.in_flight[i] += 1
        self.sent[i] += 1
        return i

    def release(self, i: int) -> None:
        self.in_flight[i] -= 1
        self._slots.release()


def sampling_params(cfg: RolloutConfig, stop_token_ids: Sequence[int] = ()) -> dict[str, Any]:
    """SGLang sampling_params for the rollout flags."""
    params: dict[str, Any] = {
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "max_new_tokens": cfg.max_response_len,
    }
    if stop_token_ids:
        params["stop_token_ids"] = list(stop_token_ids)
    return params


async def _generate_one(balancer: LoadBalancer, sample: Sample, params: dict[str, Any], reward_fn: RewardFn,
                        tokenizer) -> Sample:
    i = await balancer.acquire()
    try:
        out = await balancer.clients[i].generate(input_ids=sample.prompt_ids, sampling_params=params,
                                                 return_logprob=True, rid=f"sample-{sample.index}")
    finally:
        balancer.release(i)
    meta = out["meta_info"]
    logprob_entries = meta.get("output_token_logprobs") or []
    sample.response_ids = [int(e[1]) for e in logprob_entries] if logprob_entries else list(out["output_ids"])
    sample.rollout_logprobs = [float(e[0]) for e in logprob_entries]
    if len(sample.rollout_logprobs) != len(sample.response_ids):
        raise RuntimeError(f"engine {balancer.clients[i].base_url} returned {len(sample.rollout_logprobs)} "
                           f"log-probs for {len(sample.response_ids)} tokens (rid sample-{sample.index})")
    sample.response = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    sample.loss_mask = [1] * len(sample.response_ids)
    finish = meta.get("finish_reason") or {}
    sample.finish_reason = finish.get("type", "") if isinstance(finish, dict) else str(finish)
    sample.weight_version = meta.get("weight_version")
    sample.reward = await call_reward(reward_fn, sample)
    return sample


async def generate_groups(clients: Sequence[AsyncEngineClient], rows: Sequence[PromptRow], cfg: RolloutConfig,
                          reward_fn: RewardFn, tokenizer, first_index: int = 0, first_group: int = 0,
                          stop_token_ids: Sequence[int] = (), progress: bool = True) -> list[list[Sample]]:
    """One group of `cfg.n_samples_per_prompt` scored samples per row, in row order."""
    balancer = LoadBalancer(clients, cfg.concurrency_per_engine)
    params = sampling_params(cfg, stop_token_ids)
    counter = itertools.count(first_index)
    groups = [
        [Sample(index=next(counter), group_index=first_group + g, prompt=row.prompt, prompt_ids=list(row.prompt_ids),
                label=row.label, metadata=dict(row.metadata)) for _ in range(cfg.n_samples_per_prompt)]
        for g, row in enumerate(rows)
    ]
    bar = tqdm(total=sum(len(g) for g in groups), desc="rollout", unit="sample", disable=not progress,
               leave=False, mininterval=1.0)

    async def run(sample: Sample) -> Sample:
        done = await _generate_one(balancer, sample, params, reward_fn, tokenizer)
        bar.update(1)
        return done

    try:
        await asyncio.gather(*(run(s) for group in groups for s in group))
    finally:
        bar.close()
    return groups
