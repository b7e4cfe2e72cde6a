"""Off-policy corrections between the policy that sampled a batch (the engine: its log-probs of the
sampled tokens, `rollout`) and the trainer's old policy (`old`: recomputed by the trainer at the start of
the step, the PPO ratio's anchor), and the mismatch metrics between the two.

With r_t = pi_old(y_t) / pi_rollout(y_t) (log r_t = old - rollout, clamped to +-SAFETY_BOUND before exp,
as verl's rollout_corr_helper and slime's mismatch helper do):

Importance weights (--use-tis; `is_weights`), at a level (--tis-level):
  token      w_t = r_t
  sequence   w_t = prod_{s in sample} r_s           (unbiased, high variance; verl rollout_is=sequence)
  geometric  w_t = (prod_s r_s)^(1/|sample|)        (slime's mismatch helper, tis_level=geometric)
bounded by [lower, upper] = [--tis-clip-low, --tis-clip] in a mode (--tis-mode):
  truncate   w = clamp(w, lower, upper)             (TIS; lower 0 is verl's rollout_is_threshold=upper)
  mask       w = w inside [lower, upper], else 0    (MIS / IcePop: verl's rollout_is_threshold="lower_upper",
                                                     slime's icepop_function, AReaL's rejection action=mask)
The pg term of each token is multiplied by w (detached). Together with the PPO ratio against pi_old this is
decoupled PPO (Hilton et al. 2021, arXiv 2110.00641; AReaL's ppo_actor_loss_fn with proximal = pi_old and
behaviour = the engine): the clip anchors the update at the proximal policy, w corrects for the behaviour
policy having sampled the tokens.

Rejection (--rollout-rs, verl's options and threshold syntax; `rejection_keep`): a token or a whole sample
whose divergence estimate between the two policies is out of bounds gets weight 0. With lr = log r_t:
k1 = -lr, k2 = lr^2 / 2, k3 = e^lr - 1 - lr; options token_k{1,2,3}, seq_sum_k{1,2,3}, seq_mean_k{1,2,3},
seq_max_k{2,3} (k1 bounds are ratio bounds "lower_upper" on pi_rollout / pi_old, compared in log space; k2/k3
take an upper bound). Several options: a token is kept when every one keeps it.

Veto (--rollout-rs-veto-threshold T; `veto_keep`): a sample with a trained token of r_t < T gets weight 0 on
every token. Batch normalization (--tis-batch-normalize; `batch_norm_factor`): each micro-batch's weights are
divided by their mean there (slime's mismatch helper does it per call of its loss, a micro-batch; verl over
the whole batch), the rejections applied after.

Rejected or masked tokens keep their place in the loss denominator (the loss-agg mode's counts are of the
loss mask), as slime's and AReaL's do; verl divides by the kept tokens instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from slime_rl.config.flag_spec import IS_LEVELS, TIS_MODES
from slime_rl.config.groups import AlgoConfig
from slime_rl.config.rollout_corr import RejectionRule, parse_rejection

SAFETY_BOUND = 20.0  # exp(+-20): verl's and slime's bound on an importance log-ratio before exp


def _row_sum(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum(dim=-1, keepdim=True)


def _row_mean(x: Tensor, mask: Tensor) -> Tensor:
    return _row_sum(x, mask) / mask.sum(dim=-1, keepdim=True).clamp(min=1)


def level_log_ratio(log_r: Tensor, mask: Tensor, level: str) -> Tensor:
    """log w per token at `level` (IS_LEVELS): the token's own log r, or the sample's sum (sequence) or mean
    (geometric) of log r over its masked tokens, on every token of the sample. [B, T] -> [B, T]."""
    if level == "token":
        return log_r
    if level == "sequence":
        return _row_sum(log_r, mask).expand_as(log_r)
    if level == "geometric":
        return _row_mean(log_r, mask).expand_as(log_r)
    raise ValueError(f"unknown importance-weight level {level!r} (one of {', '.join(IS_LEVELS)})")


@dataclass
class ISWeights:
    weight: Tensor  # [B, T] the bounded weight (0 off the mask and, in mask mode, out of bounds); detached
    raw: Tensor  # [B, T] the weight before bounds (0 off the mask)
    out_of_bounds: Tensor  # [B, T] float: 1 on masked tokens whose raw weight is outside [lower, upper]


@torch.no_grad()
def is_weights(old: Tensor, rollout: Tensor, mask: Tensor, level: str = "token", mode: str = "truncate",
               upper: float = 2.0, lower: float = 0.0) -> ISWeights:
    """Importance weights of the behaviour (engine) correction, module docstring. old, rollout, mask: [B, T]."""
    if mode not in TIS_MODES:
        raise ValueError(f"unknown --tis-mode {mode!r} (one of {', '.join(TIS_MODES)})")
    m = mask.to(old.dtype)
    log_w = level_log_ratio(old - rollout, m, level)
    raw = torch.exp(log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * m
    out = ((raw < lower) | (raw > upper)).to(old.dtype) * m
    weight = raw.clamp(lower, upper) * m if mode == "truncate" else raw * (1 - out)
    return ISWeights(weight, raw, out)


@torch.no_grad()
def rejection_keep(old: Tensor, rollout: Tensor, mask: Tensor, rules: Sequence[RejectionRule]) -> Tensor:
    """[B, T] float: 1 where every rule keeps the token (a sequence rule keeps or drops a whole sample), else 0.
    Off the mask the value is that of the token's sample (it is multiplied by the mask where it is used)."""
    m = mask.to(old.dtype)
    lr = (old - rollout).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_k = {"k1": -lr, "k2": 0.5 * lr * lr, "k3": torch.exp(lr) - 1 - lr}
    keep = torch.ones_like(lr)
    for rule in rules:
        kind, k = rule.option.rsplit("_", 1)
        v = per_k[k]
        if kind == "seq_sum":
            v = _row_sum(v, m).expand_as(lr)
        elif kind == "seq_mean":
            v = _row_mean(v, m).expand_as(lr)
        elif kind == "seq_max":
            has = m.sum(dim=-1, keepdim=True) > 0
            top = torch.where(m > 0, v, torch.full_like(v, -math.inf)).amax(dim=-1, keepdim=True)
            v = torch.where(has, top, torch.zeros_like(top)).expand_as(lr)
        if k == "k1":
            ok = (v >= math.log(rule.lower)) & (v <= math.log(rule.upper))
        else:
            ok = v <= rule.upper
        keep = keep * ok.to(lr.dtype)
    return keep


@torch.no_grad()
def veto_keep(old: Tensor, rollout: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """[B, T] float: 0 on every token of a sample that has a trained token with r_t < threshold (the raw
    log r_t, unclamped, against log threshold), else 1 (--rollout-rs-veto-threshold; slime's mismatch helper
    rs_veto_threshold)."""
    bad = ((old - rollout) < math.log(threshold)) & (mask > 0)
    return (~bad.any(dim=-1, keepdim=True)).to(old.dtype).expand_as(old)


@torch.no_grad()
def batch_norm_factor(w: ISWeights, mask: Tensor, level: str, mode: str) -> Tensor:
    """The mean that --tis-batch-normalize divides this micro-batch's weights by (a 0-d tensor; 1 where the mean
    is not above 1e-8), as slime's mismatch helper (tis_batch_normalize): the bounded weights (in mask mode the
    weights before masking: the helper masks the loss, not the weight) averaged over the trained tokens at level
    token, or each sample's weight averaged over the samples with a trained token at level sequence."""
    m = mask.to(w.raw.dtype)
    bounded = w.weight if mode == "truncate" else w.raw
    if level == "token":
        mean = (bounded * m).sum() / m.sum().clamp(min=1)
    elif level == "sequence":
        has = m.sum(dim=-1) > 0
        mean = _row_mean(bounded, m).squeeze(-1)[has].sum() / has.sum().clamp(min=1)
    else:
        raise ValueError(f"--tis-batch-normalize takes --tis-level token or sequence, not {level!r}")
    return torch.where(mean > 1e-8, mean, torch.ones_like(mean))


@dataclass
class Correction:
    weight: Tensor  # [B, T] each pg term's multiplier (detached): the bounded, normalized weight, times the rejections
    out_of_bounds: Tensor  # [B, T] float: trained tokens whose raw weight is outside the bounds (--use-tis)
    is_masked: Tensor  # [B, T] float: those whose weight --tis-mode mask set to 0
    rejected: Tensor  # [B, T] float: trained tokens --rollout-rs or its veto rejected
    rejected_seqs: Tensor  # 0-d: samples with a rejected token
    vetoed_seqs: Tensor  # 0-d: samples the veto rejected
    norm: Tensor  # 0-d: --tis-batch-normalize's factor (0 without it)


@torch.no_grad()
def correction(old: Tensor, rollout: Tensor, mask: Tensor, algo: AlgoConfig) -> Correction | None:
    """The off-policy correction of one micro-batch (module docstring) that algo's flags ask for, or None."""
    rejects = bool(algo.rollout_rs) or algo.rollout_rs_veto_threshold is not None
    if not (algo.use_tis or rejects):
        return None
    m = mask.to(old.dtype)
    zeros, zero = torch.zeros_like(m), m.new_zeros(())
    weight, out, masked, norm = torch.ones_like(m), zeros, zeros, zero
    if algo.use_tis:
        w = is_weights(old, rollout, mask, algo.tis_level, algo.tis_mode, algo.tis_clip, algo.tis_clip_low)
        weight, out = w.weight, w.out_of_bounds
        masked = out if algo.tis_mode == "mask" else zeros
        if algo.tis_batch_normalize:
            norm = batch_norm_factor(w, mask, algo.tis_level, algo.tis_mode)
            weight = weight / norm
    rejected, rejected_seqs, vetoed_seqs = zeros, zero, zero
    if rejects:
        keep = torch.ones_like(m)
        if algo.rollout_rs:
            keep = rejection_keep(old, rollout, mask, parse_rejection(algo.rollout_rs, algo.rollout_rs_threshold))
        if algo.rollout_rs_veto_threshold is not None:
            vetoed = veto_keep(old, rollout, mask, algo.rollout_rs_veto_threshold)
            vetoed_seqs = (((1 - vetoed) * m).sum(dim=-1) > 0).sum().to(m.dtype)
            keep = keep * vetoed
        rejected = (1 - keep) * m
        rejected_seqs = (rejected.sum(dim=-1) > 0).sum().to(m.dtype)
        weight = weight * keep
    return Correction(weight, out, masked, rejected, rejected_seqs, vetoed_seqs, norm)


# Mismatch metric sums over trained tokens / samples with a trained token (`mismatch_sums`); the *_max keys
# are maxima (the "_negmin" ones the maximum of the negated value, i.e. minus the minimum)
MISMATCH_KEYS = ("mm_tokens", "mm_k1", "mm_k3", "mm_ratio", "mm_chi2_token", "mm_ratio_max", "mm_ratio_negmin",
                 "mm_seqs", "mm_training_log_ppl", "mm_rollout_log_ppl", "mm_training_ppl", "mm_rollout_ppl",
                 "mm_log_ppl_diff", "mm_log_ppl_abs_diff", "mm_ppl_ratio", "mm_chi2_seq",
                 "mm_log_ppl_diff_max", "mm_log_ppl_diff_negmin")
MISMATCH_MAX_KEYS = ("mm_ratio_max", "mm_ratio_negmin", "mm_log_ppl_diff_max", "mm_log_ppl_diff_negmin")


@torch.no_grad()
def mismatch_sums(old: Tensor, rollout: Tensor, mask: Tensor) -> Tensor:
    """[len(MISMATCH_KEYS)] float64: sums (and maxima) from which `mismatch_metrics` gives means over tokens and
    over samples; additive across micro-batches and DP ranks (maxima by max). old, rollout, mask: [B, T]."""
    old, rollout = old.double(), rollout.double()
    m = mask.double()
    lr = old - rollout
    r = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    neg_inf = torch.full_like(r, -math.inf)
    has = m.sum(dim=-1) > 0
    n_seq = has.sum().double()
    train_mean = _row_mean(old, m).squeeze(-1)[has]
    roll_mean = _row_mean(rollout, m).squeeze(-1)[has]
    diff = roll_mean - train_mean
    seq_lr = _row_sum(lr, m).squeeze(-1)[has]

    def top(x: Tensor) -> Tensor:
        return x.max() if x.numel() else torch.tensor(-math.inf, dtype=torch.float64)

    return torch.stack([
        m.sum(), ((rollout - old) * m).sum(), ((r - lr - 1) * m).sum(), (r * m).sum(), (r * r * m).sum(),
        top(torch.where(m > 0, r, neg_inf)), top(torch.where(m > 0, -r, neg_inf)),
        n_seq, (-train_mean).sum(), (-roll_mean).sum(), torch.exp(-train_mean).sum(), torch.exp(-roll_mean).sum(),
        diff.sum(), diff.abs().sum(), torch.exp(diff).sum(),
        torch.exp(2 * seq_lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)).sum(), top(diff), top(-diff)])


def mismatch_metrics(sums: dict[str, float], prefix: str = "train/rollout_corr/") -> dict[str, float]:
    """verl's rollout_corr metric names (compute_offpolicy_metrics) from summed `mismatch_sums`, plus the
    per-token ratio's mean / max / min:
      kl: mean(rollout - old) (k1 of KL(pi_rollout || pi_old)); k3_kl: mean(r - log r - 1);
      training_log_ppl / rollout_log_ppl: mean over samples of -mean_t logp; training_ppl / rollout_ppl: mean
      over samples of exp(-mean_t logp); log_ppl_diff (abs, max, min): rollout_log_ppl_i's gap, i.e. mean_t
      rollout - mean_t old per sample; ppl_ratio: mean over samples of exp(that); chi2_token: mean(r^2) - 1;
      chi2_seq: mean over samples of (prod_t r_t)^2 - 1; ratio_mean / ratio_max / ratio_min: of r_t."""
    n, s = max(sums["mm_tokens"], 1.0), max(sums["mm_seqs"], 1.0)

    def finite(x: float) -> float:
        return x if math.isfinite(x) else 0.0

    out = {"kl": sums["mm_k1"] / n, "k3_kl": sums["mm_k3"] / n,
           "training_log_ppl": sums["mm_training_log_ppl"] / s, "rollout_log_ppl": sums["mm_rollout_log_ppl"] / s,
           "training_ppl": sums["mm_training_ppl"] / s, "rollout_ppl": sums["mm_rollout_ppl"] / s,
           "log_ppl_diff": sums["mm_log_ppl_diff"] / s, "log_ppl_abs_diff": sums["mm_log_ppl_abs_diff"] / s,
           "log_ppl_diff_max": finite(sums["mm_log_ppl_diff_max"]),
           "log_ppl_diff_min": finite(-sums["mm_log_ppl_diff_negmin"]),
           "ppl_ratio": sums["mm_ppl_ratio"] / s, "chi2_token": sums["mm_chi2_token"] / n - 1.0,
           "chi2_seq": sums["mm_chi2_seq"] / s - 1.0, "ratio_mean": sums["mm_ratio"] / n,
           "ratio_max": finite(sums["mm_ratio_max"]), "ratio_min": finite(-sums["mm_ratio_negmin"])}
    return {prefix + k: v for k, v in out.items()}
