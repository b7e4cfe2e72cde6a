"""KL estimators between the policy and a reference, per token. Pure tensor math."""

from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi, [B, T] -> [B, T].

    With log r = ref_logp - logp (Schulman's estimators, http://joschu.net/blog/kl-approx.html):
      k1 = -log r;  k2 = (log r)^2 / 2;  k3 = r - 1 - log r (unbiased, >= 0).
    low_var_kl is k3 with log r clamped to [-20, 20] and the result to [-10, 10], as verl does,
    so one extreme token cannot dominate the loss. (slime's low_var_kl clamps only the result;
    the two agree whenever |log r| <= 20.) Needs the reference model's log-probs of the same tokens.
    """
    log_ratio = ref_logp - logp
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.exp(log_ratio) - 1 - log_ratio
    if kind == "low_var_kl":
        lr = torch.clamp(log_ratio, -20, 20)
        return torch.clamp(torch.exp(lr) - 1 - lr, -10, 10)
    raise ValueError(f"unknown KL estimator {kind!r} ({', '.join(KL_ESTIMATORS)})")
