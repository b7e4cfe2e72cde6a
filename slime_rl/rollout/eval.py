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

from slime_rl.data import PromptRow
from slime_rl.engines.client import AsyncEngineClient
from slime_rl.rewards import GroupReward, RewardFn
from slime_rl.rollout.custom import GenerateFn, generate_default
from slime_rl.rollout.generate import make_groups, run_group
from slime_rl.rollout.routing import ClientPool

EVAL_GROUP_BASE = 10**9  # eval group numbers sit apart from training's (both show up in engine logs)


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


async def evaluate(clients: Sequence[AsyncEngineClient], rows: Sequence[PromptRow], n_samples: int,
                   sampling_params: dict[str, Any], reward_fn: RewardFn | GroupReward, tokenizer: Any, *,
                   ks: Sequence[int] | None = None, pass_threshold: float = 0.0,
                   generate_fn: GenerateFn = generate_default, concurrency_per_engine: int = 64,
                   max_context_len: int | None = None) -> dict[str, float]:
    """Generate `n_samples` per row with `sampling_params` (SGLang's; `max_new_tokens` is the response
    budget) and summarise: {"reward_mean", "pass@1", "pass@2", ..., "n_samples"}."""
    if n_samples < 1:
        raise ValueError(f"--n-samples-per-eval-prompt {n_samples}: must be >= 1")
    if "max_new_tokens" not in sampling_params:
        raise ValueError("evaluate: sampling_params needs max_new_tokens (--eval-max-response-len)")
    pool = ClientPool(clients, tokenizer, concurrency_per_engine, max_context_len)
    groups = make_groups(rows, n_samples, itertools.count(), itertools.count(EVAL_GROUP_BASE))
    # an eval sample cut by an engine pause is still scored: eval has no next step to continue it
    try:
        await asyncio.gather(*(run_group(pool, g, dict(sampling_params), generate_fn, reward_fn,
                                         score_unfinished=True) for g in groups))
    finally:
        await pool.aclose()
    return summarize([[float(s.reward) for s in g] for g in groups], ks, pass_threshold)
