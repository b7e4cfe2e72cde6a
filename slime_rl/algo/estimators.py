"""One object per advantage estimator: where its advantages are computed, from what, and the
policy loss it trains with. The rollout side (RolloutManager) and the trainer side
(trainer/objective.py) ask `estimator_for(algo)`; neither compares estimator names.

What an estimator needs and implies (critic, token-level advantages, KL in the rewards, the loss
aggregation its paper uses) is declared in `slime_rl/config/estimators.py` -- the config room sits
above this one and validates flags with it -- and each object here carries that spec as `.spec`.
The two registries must name the same estimators (checked at import).

| estimator                    | rollout side (per sample)    | trainer side (per token, then whitened)   | pg loss |
|------------------------------|------------------------------|-------------------------------------------|---------|
| grpo (Dr.GRPO: no std)       | grpo_advantages              | -- (the scalar, broadcast)                | PPO clip|
| gspo                         | grpo_advantages              | --                                        | GSPO    |
| cispo                        | grpo_advantages              | --                                        | CISPO   |
| sapo                         | grpo_advantages              | --                                        | SAPO    |
| rloo                         | rloo_advantages              | --                                        | PPO clip|
| reinforce_plus_plus          | 0 (unused)                   | discounted returns of token rewards       | PPO clip|
| reinforce_plus_plus_baseline | group_mean_baseline          | baseline_token_advantages                 | PPO clip|
| ppo                          | 0 (unused)                   | GAE on the critic's values (+ returns)    | PPO clip|

A new estimator: an `EstimatorSpec` in config/estimators.py and an `Estimator` subclass here,
registered with `@register`.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from slime_rl.algo.advantages import (
    baseline_token_advantages,
    gae_advantages,
    group_mean_baseline,
    grpo_advantages,
    outcome_token_rewards,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from slime_rl.algo.cispo import cispo_loss, cispo_weight
from slime_rl.algo.gspo import gspo_loss, gspo_seq_log_ratio
from slime_rl.algo.losses import ClipFractions, clip_fractions, ppo_clip_loss
from slime_rl.algo.sapo import sapo_loss
from slime_rl.config.estimators import ESTIMATOR_SPECS, EstimatorSpec
from slime_rl.config.groups import AlgoConfig


class Estimator:
    """Base: the PPO clipped policy loss; subclasses give the advantages."""

    name: ClassVar[str]
    spec: ClassVar[EstimatorSpec]

    def rollout_advantages(self, rewards: Tensor, algo: AlgoConfig) -> Tensor:
        """rewards [G, n] (G groups of n samples, shaped rewards) -> [G, n] float advantages, one
        scalar per sample, broadcast to its response tokens by the trainer. Estimators whose
        advantages are token-level return what their trainer half reads as `scalar` (or 0)."""
        raise NotImplementedError

    def token_advantages(self, rewards: Tensor, scalar: Tensor, mask: Tensor, kl: Tensor | None,
                         values: Tensor | None, algo: AlgoConfig) -> tuple[Tensor, Tensor | None]:
        """Trainer side, only for `spec.advantages_on == "trainer"`: rewards [B] (one per sample),
        scalar [B] (`rollout_advantages`, flattened), mask / kl / values [B, T] (kl: the per-token
        KL(old || ref) estimate when --kl-coef > 0; values: the critic's, when `spec.critic`).
        Returns (advantages [B, T] before whitening, returns [B, T] for the critic or None)."""
        raise TypeError(f"--advantage-estimator {self.name}: advantages are computed on the rollout side")

    def policy_loss(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                    algo: AlgoConfig) -> tuple[Tensor, Tensor, ClipFractions]:
        """Per-token policy-gradient loss [b, T] (no reduction), the clipped indicator [b, T] and
        the clip fractions (upper / lower / dual) for the metrics."""
        pg, clipped = ppo_clip_loss(logp, old_logp, advantages, algo.eps_clip, algo.eps_clip_high, algo.eps_clip_c)
        frac = clip_fractions(logp, old_logp, advantages, algo.eps_clip, algo.eps_clip_high, algo.eps_clip_c)
        return pg, clipped, frac


ESTIMATORS: dict[str, Estimator] = {}


def register(cls: type[Estimator]) -> type[Estimator]:
    """Class decorator: pair `cls` with the config spec of the same name and register one instance."""
    if cls.name not in ESTIMATOR_SPECS:
        raise TypeError(f"estimator {cls.name!r} has no EstimatorSpec in slime_rl/config/estimators.py")
    cls.spec = ESTIMATOR_SPECS[cls.name]
    ESTIMATORS[cls.name] = cls()
    return cls


def estimator_for(algo: AlgoConfig) -> Estimator:
    """The estimator object of `algo.advantage_estimator`."""
    try:
        return ESTIMATORS[algo.advantage_estimator]
    except KeyError:
        raise ValueError(f"--advantage-estimator {algo.advantage_estimator!r} is not one of "
                         f"{', '.join(ESTIMATORS)}") from None


@register
class GRPO(Estimator):
    """GRPO; with --disable-grpo-std-normalization, Dr.GRPO (mean-centred only)."""

    name = "grpo"

    def rollout_advantages(self, rewards: Tensor, algo: AlgoConfig) -> Tensor:
        return grpo_advantages(rewards, normalize_std=algo.normalize_group_std)


@register
class GSPO(GRPO):
    """GRPO's advantages; the loss clips the sequence-level ratio (algo/gspo.py)."""

    name = "gspo"

    def policy_loss(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                    algo: AlgoConfig) -> tuple[Tensor, Tensor, ClipFractions]:
        pg, clipped = gspo_loss(logp, old_logp, advantages, mask, algo.eps_clip, algo.eps_clip_high,
                                algo.eps_clip_c)
        # clip bounds of the sequence ratio s_i, on every token of sample i
        log_s = gspo_seq_log_ratio(logp.detach(), old_logp, mask).unsqueeze(1).expand_as(logp)
        frac = clip_fractions(log_s, torch.zeros_like(log_s), advantages, algo.eps_clip, algo.eps_clip_high,
                              algo.eps_clip_c)
        return pg, clipped, frac


@register
class CISPO(GRPO):
    """GRPO's advantages; the loss weights each token's log-prob gradient by its clipped, detached ratio
    (algo/cispo.py). The clip fractions count the weights cut at each bound, whatever the advantage's sign."""

    name = "cispo"

    def policy_loss(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                    algo: AlgoConfig) -> tuple[Tensor, Tensor, ClipFractions]:
        pg, clipped = cispo_loss(logp, old_logp, advantages, algo.eps_clip, algo.eps_clip_high)
        _, ratio = cispo_weight(logp, old_logp, algo.eps_clip, algo.eps_clip_high)
        high = (ratio > 1.0 + algo.eps_clip_high).float()
        low = (ratio < 1.0 - algo.eps_clip).float()
        return pg, clipped, ClipFractions(high, low, torch.zeros_like(high))


@register
class SAPO(GRPO):
    """GRPO's advantages; the loss gates each token's ratio softly (algo/sapo.py): no token is clipped, so
    the clip fractions are 0."""

    name = "sapo"

    def policy_loss(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                    algo: AlgoConfig) -> tuple[Tensor, Tensor, ClipFractions]:
        pg = sapo_loss(logp, old_logp, advantages, algo.sapo_tau_pos, algo.sapo_tau_neg)
        zero = torch.zeros_like(pg).detach()
        return pg, zero, ClipFractions(zero, zero, zero)


@register
class RLOO(Estimator):
    name = "rloo"

    def rollout_advantages(self, rewards: Tensor, algo: AlgoConfig) -> Tensor:
        return rloo_advantages(rewards)


class _TokenLevel(Estimator):
    def rollout_advantages(self, rewards: Tensor, algo: AlgoConfig) -> Tensor:
        return torch.zeros_like(rewards)  # the trainer builds the advantages from `rewards`


@register
class ReinforcePlusPlus(_TokenLevel):
    """Discounted returns (gamma) of token rewards: -kl_coef * KL on every token, the reward on the last."""

    name = "reinforce_plus_plus"

    def token_advantages(self, rewards: Tensor, scalar: Tensor, mask: Tensor, kl: Tensor | None,
                         values: Tensor | None, algo: AlgoConfig) -> tuple[Tensor, Tensor | None]:
        raw, _ = reinforce_plus_plus_advantages(rewards, mask, kl, algo.kl_coef, algo.gamma, whiten=False)
        return raw, None


@register
class ReinforcePlusPlusBaseline(Estimator):
    """The group-mean baseline per sample on the rollout side; the trainer spreads it over the
    sample's tokens (minus kl_coef * KL) and whitens over the batch."""

    name = "reinforce_plus_plus_baseline"

    def rollout_advantages(self, rewards: Tensor, algo: AlgoConfig) -> Tensor:
        return group_mean_baseline(rewards)

    def token_advantages(self, rewards: Tensor, scalar: Tensor, mask: Tensor, kl: Tensor | None,
                         values: Tensor | None, algo: AlgoConfig) -> tuple[Tensor, Tensor | None]:
        return baseline_token_advantages(scalar, mask, kl, algo.kl_coef), None


@register
class PPO(_TokenLevel):
    """GAE (gamma, lambd) against the critic's values, on REINFORCE++'s token rewards; the returns
    R = A + V (before whitening) are the critic's targets."""

    name = "ppo"

    def token_advantages(self, rewards: Tensor, scalar: Tensor, mask: Tensor, kl: Tensor | None,
                         values: Tensor | None, algo: AlgoConfig) -> tuple[Tensor, Tensor | None]:
        if values is None:
            raise ValueError("--advantage-estimator ppo needs the critic's values of every response token")
        token_rewards = outcome_token_rewards(rewards, mask, kl, algo.kl_coef)
        return gae_advantages(token_rewards, values, mask, algo.gamma, algo.lambd)


if set(ESTIMATORS) != set(ESTIMATOR_SPECS):  # a spec without math, or math without a spec
    raise TypeError(f"estimators without an algo object: {sorted(set(ESTIMATOR_SPECS) - set(ESTIMATORS))}")
