"""What each `--advantage-estimator` is, as the config room needs to know it (no math here).

The rooms' import order puts `config` above `algo`, so an estimator's declaration lives here and its
math in `slime_rl/algo/estimators.py`, which pairs one `Estimator` object with each spec by name (and
fails at import when the two registries differ). The flag's choices, the validation in `load.py` and
the `AlgoConfig` properties read these specs; nothing compares estimator names as strings.

A new estimator: one `EstimatorSpec` in `ESTIMATOR_SPECS` below, one `Estimator` subclass in
`slime_rl/algo/estimators.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class EstimatorSpec:
    """name: the `--advantage-estimator` value.
    advantages_on: "rollout" -- one scalar per sample from the group's rewards, computed by the
      RolloutManager and broadcast to the sample's tokens; "trainer" -- per-token advantages the
      trainer builds (they need log-probs, the critic's values or whitening over the whole batch).
    critic: needs a value model (PPO's GAE); the --critic-* flags are accepted only then.
    kl_in_rewards: folds --kl-coef * KL(old || ref) into per-token rewards (else --kl-coef is refused).
    sequence_ratio: the policy loss clips a sequence-level ratio (GSPO) instead of per-token ratios.
    dual_clip: the policy loss is PPO's clipped minimum, which --eps-clip-c's dual clip caps (PPO's and GSPO's;
      CISPO and SAPO have no such minimum: the flag is refused with them).
    loss_agg_mode: the aggregation the method's paper uses, when it is not --loss-agg-mode's default
      (token-mean); `load.py` warns when the run aggregates otherwise (the default is not changed, so
      no existing recipe's numbers move).
    """

    name: str
    advantages_on: Literal["rollout", "trainer"]
    critic: bool = False
    kl_in_rewards: bool = False
    sequence_ratio: bool = False
    dual_clip: bool = True
    loss_agg_mode: str | None = None

    @property
    def token_level_advantages(self) -> bool:
        return self.advantages_on == "trainer"


ESTIMATOR_SPECS: dict[str, EstimatorSpec] = {s.name: s for s in (
    # GRPO; Dr.GRPO is grpo with --disable-grpo-std-normalization (and seq-mean-token-sum-norm)
    EstimatorSpec("grpo", "rollout"),
    EstimatorSpec("rloo", "rollout"),
    EstimatorSpec("reinforce_plus_plus", "trainer", kl_in_rewards=True),
    # the group-mean baseline on the rollout side, the whitening over the batch on the trainer side
    EstimatorSpec("reinforce_plus_plus_baseline", "trainer"),
    # GRPO's advantages with a sequence-level ratio; the paper (and verl) average per sequence first. Its loss is
    # PPO's clipped minimum on that ratio, which --eps-clip-c caps as EasyR1 does (verl's GSPO: no dual clip)
    EstimatorSpec("gspo", "rollout", sequence_ratio=True, loss_agg_mode="seq-mean-token-mean"),
    # GRPO's advantages with MiniMax-M1's clipped IS-weight loss (algo/cispo.py); the paper averages over
    # all tokens (token-mean, the default)
    EstimatorSpec("cispo", "rollout", dual_clip=False),
    # GRPO's advantages with SAPO's soft gate on the ratio (algo/sapo.py)
    EstimatorSpec("sapo", "rollout", dual_clip=False),
    EstimatorSpec("ppo", "trainer", critic=True, kl_in_rewards=True),
)}

ADVANTAGE_ESTIMATORS: tuple[str, ...] = tuple(ESTIMATOR_SPECS)


def estimator_spec(name: str) -> EstimatorSpec:
    """The spec of `--advantage-estimator name` (ValueError naming the flag for an unknown one)."""
    try:
        return ESTIMATOR_SPECS[name]
    except KeyError:
        raise ValueError(f"--advantage-estimator {name!r} is not one of {', '.join(ESTIMATOR_SPECS)}") from None
