"""What the trainer optimises: per-token advantages of a step, the per-micro-batch policy objective,
and the step's metrics. The math is slime_rl.algo's (the estimator object, algo.estimator_for, gives
the advantages and the pg loss); this module decides which pieces the AlgoConfig switches on and how
they are reduced across micro-batches and DP ranks.

Advantages (once per train_step, before the mini-batches; they do not change within a step):
  * scalar estimators (grpo, gspo, rloo): the batch's per-sample `advantages`, broadcast to the
    sample's response tokens by the micro-batch builder;
  * reinforce_plus_plus: token rewards r_t = -kl_coef * kl(old_logp, ref_logp)_t (kl_loss_type),
    plus the sample's scalar `rewards` at its last trained token; discounted returns (gamma);
  * reinforce_plus_plus_baseline: the group-centred scalar `advantages` on every trained token,
    minus kl_coef * kl_t when kl_coef > 0 (as slime_rl.algo's estimator does);
  * ppo: the same token rewards as reinforce_plus_plus (reward on the last trained token, minus
    kl_coef * kl_t), GAE (gamma, lambd) against the critic's values of the response tokens; the
    returns R = A + V (before whitening) are the critic's targets;
  and the token-level ones are whitened with the mean / unbiased std over ALL trained tokens of
  the step's batch on every DP rank (masked_moments all-reduced over the DP group).

Policy objective per token ([b, T]; the micro-batch returns sum_t loss_weight * loss_t, the
weights carrying the loss_agg_mode's global denominators, see loss_agg.py):
  loss_t = w_t * pg_t + kl_loss_coef * kl(logp, ref_logp)_t - entropy_coef * H_t
  pg_t: the estimator's policy_loss: ppo_clip_loss (clip-higher, dual clip with eps_clip_c) or, for
    gspo, gspo_loss (the sequence-level ratio; a sample is always whole in one micro-batch: packing
    never splits one; eps_clip_c is not applied to gspo);
  w_t: the off-policy correction of algo.offpolicy, 1 without one: --use-tis's importance weights
    pi_old / pi_engine (token, sequence or geometric; truncated or masked to [tis_clip_low, tis_clip]),
    times 0 on tokens --rollout-rs rejects;
  the KL term when use_kl_loss or kl_loss_coef > 0; the entropy term when entropy_coef > 0 (H is
  the differentiable vocab-parallel entropy of softmax(logits / temperature)).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from slime_rl.algo import estimator_for, kl_penalty, masked_moments, masked_sum, masked_whiten
from slime_rl.algo.offpolicy import (
    MISMATCH_KEYS,
    MISMATCH_MAX_KEYS,
    Correction,
    correction,
    mismatch_metrics,
    mismatch_sums,
)
from slime_rl.config.groups import AlgoConfig
from slime_rl.trainer.batching import MicroBatch

# per-micro-batch sums (summed over micro-batches and DP); every one is a masked token sum except
# "entropy_agg" and "loss", which are this micro-batch's share of the aggregated (loss_agg) value
# "entropy_old" and "abs_diff" (entropy, |old - rollout|) are filled only on the fused path, where the
# old log-probs are the training forward's own (see `policy_objective`'s `fused_old`)
# "abs_diff_max" (the largest |old - rollout| of a trained token) is the one that is not a sum: it is
# combined by max over micro-batches and DP ranks (MAX_STAT_KEYS: `combine_stats`, `dp_reduce_stats`)
# "is_masked" / "rs_masked": trained tokens whose weight --tis-mode mask / --rollout-rs set to 0; "rs_seqs" /
# "seqs": samples with a token --rollout-rs (or its veto) rejected / with a trained token; "veto_seqs": samples
# --rollout-rs-veto-threshold rejected; "tis_norm" / "micro_batches": --tis-batch-normalize's factors and the
# micro-batches they are of (a sum and a count, 1 each); the MISMATCH_KEYS (algo.offpolicy)
# are filled only on the fused path, like "entropy_old" (step_sums computes them otherwise)
STAT_KEYS = ("pg", "kl", "clipped", "clip_high", "clip_low", "k1_old_new", "entropy_agg", "tis_w",
             "tis_clipped", "tokens", "loss", "clip_dual", "entropy_old", "abs_diff", "abs_diff_max",
             "is_masked", "rs_masked", "rs_seqs", "seqs", "veto_seqs", "tis_norm", "micro_batches", *MISMATCH_KEYS)
MAX_STAT_KEYS = ("abs_diff_max", *MISMATCH_MAX_KEYS)
_MAX_INDEX = [STAT_KEYS.index(k) for k in MAX_STAT_KEYS]


def combine_stats(per_micro: Tensor) -> Tensor:
    """[n_micro, len(STAT_KEYS)] -> [len(STAT_KEYS)]: sums, and max for MAX_STAT_KEYS."""
    out = per_micro.sum(dim=0)
    out[_MAX_INDEX] = per_micro[:, _MAX_INDEX].max(dim=0).values
    return out


def dp_reduce_stats(values: list[float], all_reduce: Callable[..., list[float]]) -> dict[str, float]:
    """STAT_KEYS over the DP group: `all_reduce(values, op)` summed, and MAX_STAT_KEYS by max."""
    summed = all_reduce(values)
    out = dict(zip(STAT_KEYS, summed, strict=True))
    if _MAX_INDEX:
        maxed = all_reduce([values[i] for i in _MAX_INDEX], dist.ReduceOp.MAX)
        out.update(zip(MAX_STAT_KEYS, maxed, strict=True))
    return out


def uses_kl_loss(algo: AlgoConfig) -> bool:
    return algo.use_kl_loss or algo.kl_loss_coef > 0


def uses_mismatch_metrics(algo: AlgoConfig) -> bool:
    """Whether a step logs train/rollout_corr/* (algo.offpolicy.mismatch_metrics)."""
    return (algo.get_mismatch_metrics or algo.use_tis or bool(algo.rollout_rs)
            or algo.rollout_rs_veto_threshold is not None)


# ---- advantages (once per train step)
def _pad(rows: Sequence[Sequence[float]], width: int) -> Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.float64)
    return out


def _all_reduce(t: Tensor, device: torch.device, group: dist.ProcessGroup | None,
                op: dist.ReduceOp = dist.ReduceOp.SUM) -> Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return t
    on_dev = t.to(device)
    dist.all_reduce(on_dev, op=op, group=group)
    return on_dev.cpu()


def token_advantages(algo: AlgoConfig, batch: dict, old_logprobs: list, ref_logprobs: list | None,
                     device: torch.device, group: dist.ProcessGroup | None, values: list | None = None
                     ) -> tuple[list[list[float]], list[list[float]] | None]:
    """Per-token advantages of this rank's samples (module docstring), whitened with moments
    all-reduced over `group` (the DP group): every rank must call it. `values`: the critic's
    per-token values (ppo only). Returns (advantages, returns), one list per sample (response
    length), 0 on untrained tokens; returns (GAE's A + V, not whitened) only for ppo, else None."""
    estimator = estimator_for(algo)
    assert estimator.spec.token_level_advantages, algo.advantage_estimator
    lens = [int(r) for r in batch["response_lengths"]]
    width = max(lens)
    mask = _pad(batch["loss_masks"], width)
    kl = None
    if algo.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("--kl-coef > 0 needs the reference model's log-probs")
        kl = kl_penalty(_pad(old_logprobs, width), _pad(ref_logprobs, width), algo.kl_loss_type)
    if estimator.spec.critic and (values is None or [len(v) for v in values] != lens):
        raise ValueError(f"--advantage-estimator {algo.advantage_estimator} needs the critic's values of every "
                         "response token")
    rewards = torch.tensor([float(r) for r in batch["rewards"]], dtype=torch.float64)
    scalar = torch.tensor([float(a) for a in batch["advantages"]], dtype=torch.float64)  # the rollout side's
    raw, ret = estimator.token_advantages(rewards, scalar, mask, kl, None if values is None else _pad(values, width),
                                          algo)
    returns = None if ret is None else [row[:n] for row, n in zip(ret.tolist(), lens, strict=True)]
    moments = _all_reduce(masked_moments(raw, mask), device, group)
    adv = masked_whiten(raw, mask, moments=moments)
    return [row[:n] for row, n in zip(adv.tolist(), lens, strict=True)], returns


def opd_advantages(algo: AlgoConfig, batch: dict, old_logprobs: list, teacher_logprobs: list,
                   token_adv: list | None) -> list[list[float]]:
    """slime's on-policy distillation (--use-opd, loss.py apply_opd_kl_to_advantages): each response token's
    advantage A_t - opd_kl_coef x (old_logp_t - teacher_logp_t), the reverse KL to the teacher taken as a
    per-token penalty, after the advantage estimator. `token_adv`: the estimator's per-token advantages, or
    None for one scalar per sample (batch["advantages"], every token of the sample). In float64."""
    coef = algo.opd_kl_coef
    out = []
    for i, (old, teacher) in enumerate(zip(old_logprobs, teacher_logprobs, strict=True)):
        base = token_adv[i] if token_adv is not None else [float(batch["advantages"][i])] * len(old)
        out.append([float(a) - coef * (float(o) - float(t)) for a, o, t in zip(base, old, teacher, strict=True)])
    return out


def opd_sums(batch: dict, old_logprobs: list, teacher_logprobs: list, device: torch.device,
             group: dist.ProcessGroup | None) -> dict[str, float]:
    """DP-summed reverse KL old - teacher over the trained tokens, for train/opd_reverse_kl (token mean)."""
    lens = [int(r) for r in batch["response_lengths"]]
    width = max(lens)
    mask = _pad(batch["loss_masks"], width)
    gap = (_pad(old_logprobs, width) - _pad(teacher_logprobs, width)) * mask
    total = _all_reduce(torch.stack([gap.sum(), mask.sum()]), device, group).tolist()
    return {"opd_kl": total[0], "opd_tokens": total[1]}


@dataclass
class StepInputs:
    """What a train step computes once, before its mini-batches (per-sample lists of this rank)."""

    old: list  # old log-probs
    entropy: list  # entropy of the old policy (metrics)
    ref: list | None  # reference log-probs when algo.use_reference
    advantages: list | None  # per-token advantages when algo.token_level_advantages
    sums: dict[str, float]  # DP-summed sums for the step-level metrics (step_sums)
    returns: list | None = None  # ppo: GAE returns, the critic's targets
    # R2 (--use-routing-replay): the old-log-prob forward's routing, per sample (routing_replay.BATCH_KEY's form)
    routing: list | None = None
    # --use-rollout-logprobs: the trainer's own log-probs of the old policy (metrics only; `old` is the engine's)
    recomputed: list | None = None


def step_sums(batch: dict, inputs: StepInputs | None, device: torch.device,
              group: dist.ProcessGroup | None) -> dict[str, float]:
    """DP-summed token sums over trained tokens: entropy, |old - rollout|, count, and the
    advantages actually used (sum, sum of squares) for advantage_mean / advantage_std.
    inputs None (the fused path: no separate old-log-prob pass, no token-level advantages): the
    batch's scalar advantages; "entropy" and "abs_diff" are 0 here and come from the training
    forward's sums (`fused_step_sums`)."""
    lens = [int(r) for r in batch["response_lengths"]]
    width = max(lens)
    mask = _pad(batch["loss_masks"], width)
    if inputs is not None and inputs.advantages is not None:
        adv = _pad(inputs.advantages, width)
    else:
        adv = torch.tensor([float(a) for a in batch["advantages"]], dtype=torch.float64).unsqueeze(1) * mask
    adv_m = masked_moments(adv, mask)
    mm = torch.zeros(len(MISMATCH_KEYS), dtype=torch.float64)
    if inputs is None:
        ent = diff = diff_max = torch.zeros((), dtype=torch.float64)
    else:
        ent = (_pad(inputs.entropy, width) * mask).sum()
        mine = _pad(inputs.recomputed if inputs.recomputed is not None else inputs.old, width)
        rollout = _pad(batch["rollout_logprobs"], width)
        gap = (mine - rollout).abs() * mask
        diff, diff_max = gap.sum(), (gap.max() if gap.numel() else gap.sum())
        mm = mismatch_sums(mine, rollout, mask)
    local = torch.cat([torch.stack([ent, diff, adv_m[0], adv_m[1], adv_m[2]]), mm])
    keys = ("entropy", "abs_diff", "adv", "adv_sq", "tokens", *MISMATCH_KEYS)
    out = dict(zip(keys, _all_reduce(local, device, group).tolist(), strict=True))
    max_keys = ("abs_diff_max", *MISMATCH_MAX_KEYS)
    maxed = torch.cat([diff_max.reshape(1), mm[[MISMATCH_KEYS.index(k) for k in MISMATCH_MAX_KEYS]]])
    return out | dict(zip(max_keys, _all_reduce(maxed, device, group, dist.ReduceOp.MAX).tolist(), strict=True))


def fused_step_sums(batch_sums: dict[str, float], stats: dict[str, float]) -> dict[str, float]:
    """step_sums of the fused path: the old policy's entropy and |old - rollout| summed by the one
    training forward (its STAT_KEYS "entropy_old", "abs_diff", DP-summed like the rest)."""
    return batch_sums | {"entropy": stats["entropy_old"], "abs_diff": stats["abs_diff"],
                         "abs_diff_max": stats["abs_diff_max"]} | {k: stats[k] for k in MISMATCH_KEYS}


# ---- the per-micro-batch objective
def policy_objective(algo: AlgoConfig, logp: Tensor, mb: MicroBatch, entropy: Tensor | None = None,
                     fused_old_entropy: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """logp [b, T] (differentiable), entropy [b, T] (differentiable; needed iff entropy_coef > 0)
    -> (share: sum_t loss_weight * loss_t, this micro-batch's share of the mini-batch loss L,
    differentiable; sums: float32 [len(STAT_KEYS)], detached).

    fused_old_entropy [b, T] (detached) selects the fused path: the step has one optimizer step on
    this rank, so the old policy IS the current one and its log-probs are this forward's, detached
    (old = logp.detach(), ratio exactly 1: what TRL does with num_iterations 1 and verl when
    on-policy); the tensor is the old policy's entropy, summed into "entropy_old" with |old -
    rollout| into "abs_diff" for the step metrics, which the separate pass computes otherwise."""
    adv, mask = mb.per_token["advantages"], mb.loss_mask
    old = logp.detach() if fused_old_entropy is not None else mb.per_token["old_logp"]
    weight = mb.per_token["loss_weight"]
    pg, clipped, frac = estimator_for(algo).policy_loss(logp, old, adv, mask, algo)
    zeros = torch.zeros_like(pg).detach()
    rollout = mb.per_token["rollout_logp"]
    fix = correction(old, rollout, mask, algo)  # the behaviour correction (algo.offpolicy), or None
    if fix is None:
        z = zeros.sum()
        fix = Correction(torch.ones_like(zeros), zeros, zeros, zeros, z, z, z)
    else:
        pg = pg * fix.weight.to(pg.dtype)
    tis_w = fix.weight
    per_token = pg
    kl = zeros
    if "ref_logp" in mb.per_token:
        kl = kl_penalty(logp, mb.per_token["ref_logp"], algo.kl_loss_type)
        if uses_kl_loss(algo):
            per_token = per_token + algo.kl_loss_coef * kl
    entropy_agg = zeros.sum()
    if algo.entropy_coef > 0:
        assert entropy is not None, "entropy_coef > 0 needs the differentiable entropy"
        per_token = per_token - algo.entropy_coef * entropy
        entropy_agg = masked_sum(entropy, weight)
    share = masked_sum(per_token, weight)  # the weights vanish off the loss mask
    ent_old = abs_diff = abs_diff_max = zeros.sum()
    mismatch = torch.zeros(len(MISMATCH_KEYS), dtype=zeros.dtype, device=zeros.device)
    if fused_old_entropy is not None:
        ent_old = masked_sum(fused_old_entropy, mask)
        gap = (old - rollout).abs()
        abs_diff = masked_sum(gap, mask)
        abs_diff_max = (gap * mask).max() if gap.numel() else abs_diff_max
        mismatch = mismatch_sums(old, rollout, mask).to(zeros.dtype)
    sums = torch.stack([masked_sum(pg, mask), masked_sum(kl, mask), masked_sum(clipped, mask),
                        masked_sum(frac.high, mask), masked_sum(frac.low, mask),
                        masked_sum(old - logp, mask), entropy_agg, masked_sum(tis_w, mask),
                        masked_sum(fix.out_of_bounds, mask), mask.sum(), share, masked_sum(frac.dual, mask),
                        ent_old, abs_diff, abs_diff_max, masked_sum(fix.is_masked, mask),
                        masked_sum(fix.rejected, mask), fix.rejected_seqs, (mask.sum(dim=-1) > 0).sum().to(zeros.dtype),
                        fix.vetoed_seqs, fix.norm, torch.ones_like(fix.norm)]).detach().float()
    return share, torch.cat([sums, mismatch.detach().float()])


# ---- metrics
def train_metrics(algo: AlgoConfig, step: dict[str, float], stats: list[dict[str, float]],
                  norms: list[float], lr: float, have_ref: bool) -> dict[str, float]:
    """The train step's metrics from DP-summed sums (identical on every rank).

    step: `step_sums` of the whole step; stats: one STAT_KEYS dict per mini-batch. Token means
    are over trained tokens; per-mini-batch values (loss, pg_loss, kl, entropy_loss) are averaged
    over mini-batches, fractions are over all trained tokens of all mini-batches.
      train/loss: L (loss_agg_mode); train/pg_loss: token mean of the (TIS-weighted) pg term;
      train/kl: token mean of kl_loss_type(logp, ref_logp) with a reference model, else the k1
        estimate mean(old - logp) of the LAST mini-batch; train/ppo_kl: mean(old - logp) over all;
      train/pg_clipfrac(_high/_low): clipped tokens (upper + lower / upper / lower bound);
      train/pg_clipfrac_dual (eps_clip_c set): tokens whose loss the dual-clip cap replaced;
      train/rollout_logprob_abs_diff(_max): mean (largest) |old - rollout| over trained tokens;
      train/entropy: of the old policy; train/entropy_loss (entropy_coef > 0): the aggregated
        (loss_agg_mode) entropy of the trained policy, so L includes -entropy_coef * it;
      train/tis_weight_mean, train/tis_clipfrac (use_tis); train/advantage_mean /
      train/advantage_std (unbiased) of the advantages used, over the step's trained tokens.
    """

    def per_mini(key: str) -> float:
        return sum(s[key] / max(s["tokens"], 1.0) for s in stats) / len(stats)

    tokens = max(sum(s["tokens"] for s in stats), 1.0)

    def frac(key: str) -> float:
        return sum(s[key] for s in stats) / tokens

    last = stats[-1]
    out = step_metrics(step) | {
        "train/loss": sum(s["loss"] for s in stats) / len(stats),
        "train/pg_loss": per_mini("pg"),
        "train/kl": per_mini("kl") if have_ref else last["k1_old_new"] / max(last["tokens"], 1.0),
        "train/ppo_kl": frac("k1_old_new"),
        "train/grad_norm": sum(norms) / len(norms),
        "train/pg_clipfrac": frac("clipped"),
        "train/pg_clipfrac_high": frac("clip_high"),
        "train/pg_clipfrac_low": frac("clip_low"),
        "train/lr": lr,
    }
    if algo.eps_clip_c is not None:
        out["train/pg_clipfrac_dual"] = frac("clip_dual")
    if algo.entropy_coef > 0:
        out["train/entropy_loss"] = sum(s["entropy_agg"] for s in stats) / len(stats)
    if algo.use_tis:
        out["train/tis_weight_mean"] = frac("tis_w")  # after --rollout-rs's rejections, when both are on
        out["train/tis_clipfrac"] = frac("tis_clipped")
        if algo.tis_mode == "mask":
            out["train/rollout_corr/is_masked_fraction"] = frac("is_masked")
    seqs = max(sum(s["seqs"] for s in stats), 1.0)
    if algo.rollout_rs or algo.rollout_rs_veto_threshold is not None:
        out["train/rollout_corr/rs_masked_fraction"] = frac("rs_masked")
        out["train/rollout_corr/rs_seq_masked_fraction"] = sum(s["rs_seqs"] for s in stats) / seqs
    if algo.rollout_rs_veto_threshold is not None:
        out["train/rollout_corr/rs_veto_seq_fraction"] = sum(s["veto_seqs"] for s in stats) / seqs
    if algo.use_tis and algo.tis_batch_normalize:  # the mean factor over the step's micro-batches
        out["train/rollout_corr/batch_norm_factor"] = sum(s["tis_norm"] for s in stats) / max(
            sum(s["micro_batches"] for s in stats), 1.0)
    if uses_mismatch_metrics(algo):
        out |= mismatch_metrics(step)
    return out


def step_metrics(step: dict[str, float]) -> dict[str, float]:
    """The metrics known before any update, from `step_sums` (see train_metrics); all that a step
    without a policy update (PPO's --num-critic-only-steps) reports for the policy."""
    n = step["tokens"]
    mean = step["adv"] / max(n, 1.0)
    var = max(step["adv_sq"] / max(n, 1.0) - mean * mean, 0.0) * (n / (n - 1) if n >= 2 else 0.0)
    out = {"train/entropy": step["entropy"] / max(n, 1.0),
           "train/rollout_logprob_abs_diff": step["abs_diff"] / max(n, 1.0),
           "train/rollout_logprob_abs_diff_max": step["abs_diff_max"],
           "train/advantage_mean": mean, "train/advantage_std": math.sqrt(var)}
    if "opd_kl" in step:  # --use-opd: the token mean of old - teacher log-probs (slime's opd_reverse_kl)
        out["train/opd_reverse_kl"] = step["opd_kl"] / max(step["opd_tokens"], 1.0)
    return out
