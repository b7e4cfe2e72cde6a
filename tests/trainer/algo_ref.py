"""Cases and float64 references for the algorithm-flag tests (issue 5, trainer side).

Nothing here imports slime_rl.trainer or slime_rl.algo: log-probs, entropy and gradients come from
the HF model of the same folder in float64; advantages from tests/algo/refs.py (plain-Python
loops); losses, clipping, TIS, KL and aggregation are written out below from the papers' formulas.
The reference policy is the checkpoint with its final norm scaled by REF_NORM_SCALE (the scenario
scales the trainer's frozen copy the same way), so the KL terms are not zero at the first step.
"""

from __future__ import annotations

import math

import torch

from tests.algo import refs
from tests.trainer.trainer_ref import _response_logits

# name -> (AlgoConfig keyword arguments, loss_agg_mode, perturb old log-probs in forward_backward)
CASES: dict[str, tuple[dict, str, bool]] = {
    "rpp": ({"advantage_estimator": "reinforce_plus_plus", "kl_coef": 2.0, "kl_loss_type": "k1", "gamma": 0.9},
            "token-mean", False),
    "rpp_baseline": ({"advantage_estimator": "reinforce_plus_plus_baseline", "kl_coef": 2.0, "kl_loss_type": "k1"},
                     "token-mean", False),
    "gspo": ({"advantage_estimator": "gspo"}, "seq-mean-token-mean", True),
    "cispo": ({"advantage_estimator": "cispo"}, "token-mean", True),
    "sapo": ({"advantage_estimator": "sapo", "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05}, "token-mean", True),
    "dual_clip": ({"eps_clip_c": 3.0}, "token-mean", True),
    "tis": ({"use_tis": True, "tis_clip": 2.0, "tis_clip_low": 0.5}, "token-mean", True),
    # masked importance weights at the sample level (geometric mean) plus verl's token_k1 rejection
    "mis_rs": ({"use_tis": True, "tis_level": "geometric", "tis_mode": "mask", "tis_clip": 1.1, "tis_clip_low": 0.85,
                "rollout_rs": "token_k1", "rollout_rs_threshold": "0.29_3.0"}, "token-mean", True),
    # slime's mismatch helper (mis.yaml's tis_mode mask with rs_veto_threshold and tis_batch_normalize): masked
    # token weights in [0.5, 2], each micro-batch's (here: each sample's, mbs 1) divided by the mean of its
    # weights before the masking, and a sample with a token of ratio below e^-2 rejected whole
    "mis_helper": ({"use_tis": True, "tis_mode": "mask", "tis_clip": 2.0, "tis_clip_low": 0.5,
                    "tis_batch_normalize": True, "rollout_rs_veto_threshold": math.exp(-2.0)}, "token-mean", True),
    "entropy": ({"entropy_coef": 0.5}, "seq-mean-token-mean", True),
    "kl_loss": ({"use_kl_loss": True, "kl_loss_coef": 0.2, "kl_loss_type": "low_var_kl"}, "token-mean", True),
}

# the same case with its feature switched off: the tests check that this changes the gradient
ABLATION = {"rpp": {"kl_coef": 0.0}, "rpp_baseline": {"kl_coef": 0.0}, "gspo": {"advantage_estimator": "grpo"},
            "cispo": {"advantage_estimator": "grpo"}, "sapo": {"advantage_estimator": "grpo"},
            "dual_clip": {"eps_clip_c": None}, "tis": {"use_tis": False}, "entropy": {"entropy_coef": 0.0},
            "mis_rs": {"use_tis": False, "tis_level": "token", "tis_mode": "truncate", "rollout_rs": None},
            "mis_helper": {"tis_batch_normalize": False, "rollout_rs_veto_threshold": None},
            "kl_loss": {"use_kl_loss": False, "kl_loss_coef": 0.0}}

# old_logp = current logp + OLD_DELTA (ratio exp(-delta)); sample advantages are (1, -1, 0.5, -0.25)
# and loss masks ([1,1,1], [1,1,0,0,1,1], [1,1], [0,1,1,1]), so with eps 0.2 and c = 3 this holds
# upper-clipped (ratio 1.35, 1.65), lower-clipped (0.67, 0.74, 0.61), dual-clipped (4.5, 3.7, 3.3)
# and unclipped tokens, none within 0.05 of a bound
OLD_DELTA = ([-0.3, 0.05, 0.3], [-1.5, 0.4, -2.0, 0.1, -1.3, 0.3], [-0.5, 0.1], [0.2, -0.15, -1.2, 0.5])
# rollout_logp = (unperturbed old) + TIS_DELTA: raw TIS ratios exp(OLD_DELTA - TIS_DELTA) in and out of [0.5, 2].
# mis_rs: per sample the geometric means of those ratios over the loss mask are 1.017, 0.535, 0.905 and 0.805
# (samples 1 and 3 are out of [0.85, 1.1]); token_k1 "0.29_3.0" keeps pi_engine / pi_old in [0.29, 3], which
# rejects token 2 of sample 0 (ratio e^1.3; its PPO term has a gradient: A = 1, pi / pi_old = 0.74)
TIS_DELTA = ([0.0, 1.0, -1.0], [0.4, -0.9, 0.2, 0.0, 1.2, -0.3], [-1.1, 0.9], [0.5, 0.3, -0.5, 0.0])
EPS_CLIP = 0.2


def ref_norm_scale(hidden: int) -> torch.Tensor:
    return 1.0 + 0.3 * torch.sin(torch.arange(hidden, dtype=torch.float64))


def reference_model(model):
    """A copy of the HF policy with the final norm scaled (the scenario's frozen reference)."""
    import copy

    ref = copy.deepcopy(model)
    with torch.no_grad():
        ref.model.norm.weight.mul_(ref_norm_scale(ref.model.norm.weight.numel()).to(ref.model.norm.weight.dtype))
    return ref


def kl_est(logp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    log_r = ref - logp
    if kind == "k1":
        return -log_r
    if kind == "k3":
        return torch.exp(log_r) - 1 - log_r
    assert kind == "low_var_kl"
    lr = log_r.clamp(-20, 20)
    return (torch.exp(lr) - 1 - lr).clamp(-10, 10)


def _aggregate(values: list[torch.Tensor], masks: list[torch.Tensor], mode: str) -> torch.Tensor:
    n_tok = sum(float(m.sum()) for m in masks)
    n_seq = sum(1 for m in masks if m.sum() > 0)
    if mode == "token-mean":
        return sum((v * m).sum() for v, m in zip(values, masks, strict=True)) / n_tok
    assert mode == "seq-mean-token-mean"
    return sum((v * m).sum() / m.sum() for v, m in zip(values, masks, strict=True) if m.sum() > 0) / n_seq


def reference_advantages(kw: dict, batch: dict, old: list[list[float]], ref: list[list[float]]) -> list[list[float]]:
    """Per-token advantages the trainer should use (whitened over the whole batch), from refs.py."""
    masks = [[float(x) for x in m] for m in batch["loss_masks"]]
    est = kw.get("advantage_estimator", "grpo")
    if est not in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        return [[a * x for x in m] for a, m in zip(batch["advantages"], masks, strict=True)]
    coef, kind = kw.get("kl_coef", 0.0), kw.get("kl_loss_type", "k1")
    kl = [kl_est(torch.tensor(o, dtype=torch.float64), torch.tensor(r, dtype=torch.float64), kind).tolist()
          for o, r in zip(old, ref, strict=True)]
    if est == "reinforce_plus_plus":
        return refs.reinforce_pp(list(batch["rewards"]), masks, kl, coef, kw.get("gamma", 1.0))[0]
    raw = [[(a - coef * k[t]) * m[t] for t in range(len(m))]
           for a, k, m in zip(batch["advantages"], kl, masks, strict=True)]
    return refs.whiten(raw, masks)


def reference_step(model, ref_model, batch: dict, kw: dict, mode: str, old: list[list[float]] | None,
                   rollout: list[list[float]]) -> dict:
    """Loss, gradient (by HF name) and metric sums of one mini-batch = `batch`, float64.

    old=None: old = the current policy (ratio 1, as in a train step's first mini-batch)."""
    model.zero_grad()
    logps, ents, refs_lp, masks = [], [], [], []
    for i in range(len(batch["tokens"])):
        logits, targets = _response_logits(model, batch, i, 1.0)
        lsm = torch.log_softmax(logits, -1)
        logps.append(lsm.gather(1, targets[:, None])[:, 0])
        ents.append(-(lsm.exp() * lsm).sum(-1))
        with torch.no_grad():
            rl, rt = _response_logits(ref_model, batch, i, 1.0)
            refs_lp.append(torch.log_softmax(rl, -1).gather(1, rt[:, None])[:, 0])
        masks.append(torch.tensor(batch["loss_masks"][i], dtype=torch.float64))
    olds = [lp.detach() if old is None else torch.tensor(o, dtype=torch.float64)
            for lp, o in zip(logps, old or logps, strict=True)]
    adv = reference_advantages(kw, batch, [o.tolist() for o in olds], [r.tolist() for r in refs_lp])
    eps, eps_high, c = EPS_CLIP, EPS_CLIP, kw.get("eps_clip_c")
    pg, high, low, dual, tis_w, tis_clip = [], [], [], [], [], []
    for i, (lp, o, m) in enumerate(zip(logps, olds, masks, strict=True)):
        a = torch.tensor(adv[i], dtype=torch.float64)
        if kw.get("advantage_estimator") == "gspo":  # sequence ratio s_i = exp(mean_t (logp - old))
            ratio = torch.exp(((lp - o) * m).sum() / m.sum()).expand_as(lp)
        else:
            ratio = torch.exp(lp - o)
        r = ratio.detach()
        if kw.get("advantage_estimator") == "sapo":  # the soft gate (4 / tau) sigmoid(tau (r - 1)), no clip
            tau = torch.where(a > 0, torch.full_like(a, kw["sapo_tau_pos"]), torch.full_like(a, kw["sapo_tau_neg"]))
            loss = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * a
            high.append(torch.zeros_like(r))
            low.append(torch.zeros_like(r))
        elif kw.get("advantage_estimator") == "cispo":  # MiniMax-M1 eq. 4: -sg(clip(r)) * A * logp, every token
            loss = -r.clamp(1 - eps, 1 + eps_high) * a * lp
            high.append((r > 1 + eps_high).double())
            low.append((r < 1 - eps).double())
        else:
            loss = -torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps_high) * a)
            high.append(((a > 0) & (r > 1 + eps_high)).double())
            low.append(((a < 0) & (r < 1 - eps)).double())
        if c is not None:
            loss = torch.where(a < 0, torch.minimum(loss, -c * a), loss)
        if c is not None:  # the dual-clip cap -c * A is the smaller loss exactly when r > c
            dual.append(((a < 0) & (r > c)).double())
        log_w = o - torch.tensor(rollout[i], dtype=torch.float64)  # log pi_old / pi_engine per token
        if kw.get("use_tis"):
            lo, hi = kw["tis_clip_low"], kw["tis_clip"]
            if kw.get("tis_level", "token") == "geometric":  # the sample's mean log-ratio on each of its tokens
                raw_w = torch.exp((log_w * m).sum() / m.sum()).expand_as(log_w)
            else:
                raw_w = torch.exp(log_w)
            out = (raw_w > hi) | (raw_w < lo)
            w = torch.where(out, 0.0, raw_w) if kw.get("tis_mode") == "mask" else raw_w.clamp(lo, hi)
            if kw.get("tis_batch_normalize"):  # one sample per micro-batch: its weights over their mean, taken
                # over its trained tokens of the weights before the mask (slime's helper masks the loss instead)
                before = raw_w if kw.get("tis_mode") == "mask" else w
                w = w / ((before * m).sum() / m.sum())
            if kw.get("rollout_rs_veto_threshold"):  # a trained token below the threshold rejects the sample
                w = w * float(not bool(((log_w < math.log(kw["rollout_rs_veto_threshold"])) & (m > 0)).any()))
            if kw.get("rollout_rs"):  # token_k1 "lo_hi": keep pi_engine / pi_old within [lo, hi]
                assert kw["rollout_rs"] == "token_k1"
                rs_lo, rs_hi = (float(v) for v in kw["rollout_rs_threshold"].split("_"))
                w = w * ((-log_w >= math.log(rs_lo)) & (-log_w <= math.log(rs_hi))).double()
            tis_w.append(w)
            tis_clip.append(out.double())
            loss = loss * tis_w[-1]
        pg.append(loss)
    kl = [kl_est(lp, r, kw.get("kl_loss_type", "k1")) for lp, r in zip(logps, refs_lp, strict=True)]
    total = _aggregate(pg, masks, mode)
    if kw.get("use_kl_loss") or kw.get("kl_loss_coef", 0.0) > 0:
        total = total + kw["kl_loss_coef"] * _aggregate(kl, masks, mode)
    ent_agg = _aggregate(ents, masks, mode)
    if kw.get("entropy_coef", 0.0) > 0:
        total = total - kw["entropy_coef"] * ent_agg
    total.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if getattr(model.config, "tie_word_embeddings", False):
        grads.pop("lm_head.weight", None)

    def tok_sum(vals: list[torch.Tensor]) -> float:
        return sum(float((v.detach() * m).sum()) for v, m in zip(vals, masks, strict=True))

    n_tok = sum(float(m.sum()) for m in masks)
    flat_adv = [x for a, m in zip(adv, masks, strict=True) for x, k in zip(a, m.tolist(), strict=True) if k > 0]
    mean = sum(flat_adv) / len(flat_adv)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat_adv) / (len(flat_adv) - 1))
    sums = {"pg": tok_sum(pg), "kl": tok_sum(kl), "clip_high": tok_sum(high), "clip_low": tok_sum(low),
            "k1_old_new": tok_sum([o - lp for o, lp in zip(olds, logps, strict=True)]),
            "entropy_agg": float(ent_agg.detach()), "tokens": n_tok, "loss": float(total.detach())}
    if tis_w:
        sums["tis_w"], sums["tis_clipped"] = tok_sum(tis_w), tok_sum(tis_clip)
    if dual:
        sums["clip_dual"] = tok_sum(dual)
    rolls = [torch.tensor(r, dtype=torch.float64) for r in rollout]
    ratios = [float(math.exp(o - r)) for ol, rl, m in zip(olds, rolls, masks, strict=True)
              for o, r, k in zip(ol.tolist(), rl.tolist(), m.tolist(), strict=True) if k > 0]
    return {"loss": float(total.detach()), "grad": grads, "sums": sums, "advantages": adv,
            "adv_mean": mean, "adv_std": std, "entropy_mean": tok_sum(ents) / n_tok,
            # KL(engine || old) by k1 over trained tokens, and the largest pi_old / pi_engine
            "mismatch_kl": tok_sum([r - o for r, o in zip(rolls, olds, strict=True)]) / n_tok,
            "mismatch_ratio_max": max(ratios)}
