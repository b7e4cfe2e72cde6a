"""Evaluation: `n_samples` responses per prompt, mean reward and pass@k.

pass@k uses the unbiased estimator of Chen et al. 2021 (Codex paper): with n samples of which c
pass, the chance that k drawn without replacement contain at least one pass is
1 - C(n-c, k) / C(n, k), computed as a running product so large n does not overflow. It is averaged
over prompts. A sample passes when its reward exceeds `pass_threshold`.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

from slime_rl.config import EvalConfig
from slime_rl.data import PromptRow, Sample
from slime_rl.engines.client import AsyncEngineClient
from slime_rl.observability import Progress
from slime_rl.rewards import GroupReward, RewardFn
from slime_rl.rollout.custom import GenerateFn, generate_default
from slime_rl.rollout.generate import make_groups, run_group
from slime_rl.rollout.routing import ClientPool

EVAL_GROUP_BASE = 10**9  # eval group numbers sit apart from training's (both show up in engine logs)
# eval sample numbers too: under --deterministic-rollout they draw sampling seeds apart from training's,
# the same ones at every eval (config/seeds.py)
EVAL_INDEX_BASE = 10**9


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt: n samples, c of them correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k: need 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    miss = 1.0  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks = [k for k in (2**j for j in range(n.bit_length())) if k <= n]
    return ks if ks[-1] == n else ks + [n]


def summarize(rewards: Sequence[Sequence[float]], ks: Sequence[int] | None = None,
              pass_threshold: float = 0.0) -> dict[str, float]:
    """Rewards per prompt (each the same length n) -> reward_mean, pass@k for each k, and n."""
    if not rewards:
        raise ValueError("evaluate: no prompts")
    n = len(rewards[0])
    if any(len(r) != n for r in rewards):
        raise ValueError("evaluate: every prompt needs the same number of samples")
    ks = list(ks) if ks else default_ks(n)
    out = {"reward_mean": sum(map(sum, rewards)) / (n * len(rewards)), "n_samples": float(n)}
    for k in ks:
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(x > pass_threshold for x in r), k) for r in rewards) / len(rewards)
    return out


def eval_sampling_params(ev: EvalConfig, name: str | None = None) -> dict[str, Any]:
    """SGLang sampling_params of eval set `name`'s requests: --eval-temperature / --eval-top-p / --eval-top-k
    (each defaulting to its --rollout-* flag) and --eval-max-response-len, each overridden by the set's own
    --eval-config value; its `stop` / `stop_token_ids` when it gives them."""
    params = {"temperature": ev.of(name, "temperature", ev.temperature), "top_p": ev.of(name, "top_p", ev.top_p),
              "top_k": ev.of(name, "top_k", ev.top_k),
              "max_new_tokens": ev.of(name, "max_response_len", ev.max_response_len)}
    for key in ("stop", "stop_token_ids"):
        if key in ev.settings.get(name, {}):
            params[key] = list(ev.settings[name][key])
    return params


def eval_samples_per_prompt(ev: EvalConfig, name: str) -> int:
    """--n-samples-per-eval-prompt, or set `name`'s own n_samples_per_eval_prompt."""
    return ev.of(name, "n_samples_per_eval_prompt", ev.n_samples_per_prompt)


async def generate_eval(clients: Sequence[AsyncEngineClient], rows: Sequence[PromptRow], n_samples: int,
                        sampling_params: dict[str, Any], reward_fn: RewardFn | GroupReward, tokenizer: Any, *,
                        generate_fn: GenerateFn = generate_default, concurrency_per_engine: int = 64,
                        max_context_len: int | None = None, sample_seed: int | None = None,
                        progress: bool = False, progress_desc: str = "eval") -> list[list[Sample]]:
    """`n_samples` scored samples per row (one group per row, in row order) with `sampling_params`
    (SGLang's; `max_new_tokens` is the response budget). `sample_seed` (--deterministic-rollout): each
    request's sampling_seed, from sample numbers that start at EVAL_INDEX_BASE at every eval."""
    if n_samples < 1:
        raise ValueError(f"--n-samples-per-eval-prompt {n_samples}: must be >= 1")
    if "max_new_tokens" not in sampling_params:
        raise ValueError("evaluate: sampling_params needs max_new_tokens (--eval-max-response-len)")
    pool = ClientPool(clients, tokenizer, concurrency_per_engine, max_context_len, sample_seed=sample_seed)
    groups = make_groups(rows, n_samples, itertools.count(EVAL_INDEX_BASE), itertools.count(EVAL_GROUP_BASE))
    # an eval sample cut by an engine pause is still scored: eval has no next step to continue it
    try:
        with Progress(len(rows) * n_samples, progress_desc, enabled=progress) as bar:
            await asyncio.gather(*(run_group(pool, g, dict(sampling_params), generate_fn, reward_fn,
                                             on_sample=lambda _: bar.update(1), score_unfinished=True)
                                   for g in groups))
    finally:
        await pool.aclose()
    return groups


async def evaluate(clients: Sequence[AsyncEngineClient], rows: Sequence[PromptRow], n_samples: int,
                   sampling_params: dict[str, Any], reward_fn: RewardFn | GroupReward, tokenizer: Any, *,
                   ks: Sequence[int] | None = None, pass_threshold: float = 0.0, **kw: Any) -> dict[str, float]:
    """`generate_eval` (its keywords pass through), summarised: {"reward_mean", "pass@1", "pass@2", ...,
    "n_samples"}."""
    groups = await generate_eval(clients, rows, n_samples, sampling_params, reward_fn, tokenizer, **kw)
    return summarize(rewards_of(groups), ks, pass_threshold)


def rewards_of(groups: Sequence[Sequence[Sample]]) -> list[list[float]]:
    return [[float(s.reward) for s in g] for g in groups]


def pick_generations(groups_by_set: dict[str, Sequence[Sequence[Sample]]], n: int) -> list[dict[str, Any]]:
    """`n` eval samples to show (--log-eval-generations): the first sample of each prompt, in the eval
    sets' and the prompts' order, then the second of each, ...: as many different prompts as there are,
    the same ones at every eval. Each: dataset, prompt, response, label, reward."""
    out: list[dict[str, Any]] = []
    width = max((len(g) for groups in groups_by_set.values() for g in groups), default=0)
    for j in range(width):
        for name, groups in groups_by_set.items():
            for g in groups:
                if len(out) == n:
                    return out
                if j < len(g):
                    s = g[j]
                    out.append({"dataset": name, "prompt": s.prompt, "response": s.response, "label": s.label,
                                "reward": None if s.reward is None else float(s.reward)})
    return out
