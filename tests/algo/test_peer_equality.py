"""Our off-policy corrections, mismatch metrics and off-policy losses equal the peers' own code on the same random
float64 inputs: verl 0.9.1's rollout_corr_helper (importance weights, rejection, off-policy metrics) and policy
losses (CISPO, SAPO), AReaL 1.0.4's decoupled PPO loss (proximal vs behaviour policy, with its rejection
sampling) and SAPO loss. The peers run in one process of their own (tests/peers.py; launch/peers.txt pins them).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from slime_rl.algo import aggregate, ppo_clip_loss
from slime_rl.algo.cispo import cispo_loss
from slime_rl.algo.offpolicy import (
    MISMATCH_KEYS,
    MISMATCH_MAX_KEYS,
    batch_norm_factor,
    is_weights,
    mismatch_metrics,
    mismatch_sums,
    rejection_keep,
)
from slime_rl.algo.sapo import sapo_loss
from slime_rl.config.rollout_corr import parse_rejection
from tests.peers import run_peers

F64 = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-9}  # the acceptance bound is 1e-6; float64 on both sides gives far better
IS_CASES = [(level, spec) for level in ("token", "sequence") for spec in ("2.0", "0.5_2.0")]
RS_CASES = [("token_k1", "0.6_1.5"), ("token_k1", "1.5"), ("token_k2", "0.05"), ("token_k3", "0.05"),
            ("seq_sum_k1", "0.3_3.0"), ("seq_sum_k2", "0.3"), ("seq_sum_k3", "0.3"), ("seq_mean_k1", "0.8_1.25"),
            ("seq_mean_k2", "0.02"), ("seq_mean_k3", "0.02"), ("seq_max_k2", "0.2"), ("seq_max_k3", "0.2"),
            ("token_k1,seq_mean_k3", "0.5_2.0,0.02")]
DECOUPLED_CASES = list(itertools.product(("token", "sequence"), ("mask", "clamp")))


def _inputs(seed: int, b: int = 6, t: int = 9, spread: float = 0.5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, t + 1, (b,), generator=g)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).to(F64)
    mask[0, 1] = 0.0  # an environment token inside a response
    old = -3.0 * torch.rand(b, t, generator=g, dtype=F64)
    rollout = old + spread * torch.randn(b, t, generator=g, dtype=F64)
    logp = old + 0.3 * torch.randn(b, t, generator=g, dtype=F64)
    adv = torch.randn(b, 1, generator=g, dtype=F64).expand(b, t).contiguous()
    adv[1] = torch.randn(t, generator=g, dtype=F64)  # a token-level advantage row too
    return {"old": old, "rollout": rollout, "logp": logp, "adv": adv, "mask": mask}


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    """(calls, results): every call of this module's tests, run by the peers in one process."""
    x = _inputs(0)
    calls = [{"fn": "verl_is_weights", "log_ratio": x["old"] - x["rollout"], "mask": x["mask"], "level": level,
              "threshold": spec} for level, spec in IS_CASES]
    calls += [{"fn": "verl_is_weights", "log_ratio": x["old"] - x["rollout"], "mask": x["mask"], "level": level,
               "threshold": "2.0", "batch_normalize": True} for level in ("token", "sequence")]
    calls += [{"fn": "verl_rejection", "log_ratio": x["old"] - x["rollout"], "mask": x["mask"], "options": opts,
               "threshold": spec} for opts, spec in RS_CASES]
    calls.append({"fn": "verl_offpolicy_metrics", "old": x["old"], "rollout": x["rollout"], "mask": x["mask"]})
    calls.append({"fn": "verl_cispo", "old": x["old"], "logp": x["logp"], "adv": x["adv"], "mask": x["mask"],
                  "eps": 0.2, "eps_high": 0.28})
    for tau_pos, tau_neg in ((1.0, 1.05), (2.0, 0.5)):
        for fn in ("verl_sapo", "areal_sapo"):
            calls.append({"fn": fn, "old": x["old"], "logp": x["logp"], "adv": x["adv"], "mask": x["mask"],
                          "tau_pos": tau_pos, "tau_neg": tau_neg})
    calls += [{"fn": "areal_decoupled_ppo", "logp": x["logp"], "proximal": x["old"], "behaviour": x["rollout"],
               "adv": x["adv"], "mask": x["mask"], "eps": 0.2, "eps_high": 0.28, "level": level, "action": action,
               "upper": 1.6 if level == "token" else 1.1, "lower": 0.7 if level == "token" else 0.92}
              for level, action in DECOUPLED_CASES]
    return x, calls, run_peers(calls, tmp_path_factory.mktemp("peers"))


def _results(peers, fn: str) -> list[tuple[dict, dict]]:
    _, calls, results = peers
    return [(c, r) for c, r in zip(calls, results, strict=True) if c["fn"] == fn]


def test_importance_weights_equal_verls(peers):
    """verl's rollout_is token / sequence with threshold "upper" (TIS) and "lower_upper" (IcePop) are our
    --tis-level token / sequence with --tis-mode truncate (--tis-clip-low 0) and mask."""
    x = peers[0]
    got_cases = [(c, r) for c, r in _results(peers, "verl_is_weights") if not c.get("batch_normalize")]
    assert len(got_cases) == len(IS_CASES)
    for c, r in got_cases:
        lower, _, upper = c["threshold"].rpartition("_")
        w = is_weights(x["old"], x["rollout"], x["mask"], c["level"], "mask" if lower else "truncate",
                       float(upper), float(lower or 0.0))
        assert torch.allclose(w.weight, r["weights"] * x["mask"], **TOL), c
        assert not w.weight.requires_grad
    # the cases are not vacuous: each has weights cut by the bounds and weights kept as they are
    for c, r in got_cases:
        raw = is_weights(x["old"], x["rollout"], x["mask"], c["level"], "truncate", 1e30).weight
        cut = ((raw - r["weights"]).abs() > 1e-12) & (x["mask"] > 0)
        assert 0 < cut.sum() < x["mask"].sum(), c


def test_batch_normalized_weights_equal_verls(peers):
    """--tis-batch-normalize over one micro-batch that is the whole batch, --tis-mode truncate: verl's
    rollout_is_batch_normalize (token: the mean over the trained tokens; sequence: over the samples with one)
    divides by the same mean, and the weights are equal. (verl takes the mean over the whole batch; slime's
    helper, and this flag, over each micro-batch; in mask mode the helper's mean is of the weights before the
    masking, verl's after: tests/config/test_slime_mis.py checks the helper's.)"""
    x = peers[0]
    cases = [(c, r) for c, r in _results(peers, "verl_is_weights") if c.get("batch_normalize")]
    assert [c["level"] for c, _ in cases] == ["token", "sequence"]
    for c, r in cases:
        w = is_weights(x["old"], x["rollout"], x["mask"], c["level"], "truncate", 2.0, 0.0)
        norm = batch_norm_factor(w, x["mask"], c["level"], "truncate")
        # verl's masked_mean divides by the count + 1e-8 (verl.utils.torch_functional): apart by 1e-8 / count
        assert float(norm) == pytest.approx(r["rollout_is_batch_norm_factor"], rel=1e-8, abs=0), c
        assert abs(float(norm) - 1.0) > 1e-3, c  # the normalization changes the weights here
        assert torch.allclose(w.weight / norm, r["weights"] * x["mask"], rtol=1e-8, atol=1e-9), c


def test_rejection_masks_equal_verls(peers):
    """Every --rollout-rs option of verl's (and a combination) keeps exactly the tokens verl's keeps."""
    x = peers[0]
    kept_fractions = []
    for c, r in _results(peers, "verl_rejection"):
        keep = rejection_keep(x["old"], x["rollout"], x["mask"], parse_rejection(c["options"], c["threshold"]))
        assert torch.equal(keep * x["mask"], r["mask"].to(F64)), c
        kept_fractions.append(((keep * x["mask"]).sum() / x["mask"].sum()).item())
    assert len(kept_fractions) == len(RS_CASES)
    assert sum(0 < f < 1 for f in kept_fractions) >= len(RS_CASES) - 2, kept_fractions  # mostly partial


def test_mismatch_metrics_equal_verls_and_add_up_over_micro_batches(peers):
    x = peers[0]
    [(_, ref)] = _results(peers, "verl_offpolicy_metrics")
    whole = dict(zip(MISMATCH_KEYS, mismatch_sums(x["old"], x["rollout"], x["mask"]).tolist(), strict=True))
    got = mismatch_metrics(whole, prefix="")
    keys = ("kl", "k3_kl", "training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
            "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq")
    for k in keys:  # 1e-6: verl's per-sample means divide by (count + 1e-8)
        assert got[k] == pytest.approx(ref[k], rel=1e-6, abs=1e-9), k
    # two micro-batches (rows 0-2 and 3-5): sums add, maxima take the max, the metrics are the whole batch's
    parts = [mismatch_sums(x["old"][s], x["rollout"][s], x["mask"][s]) for s in (slice(0, 3), slice(3, 6))]
    combined = {}
    for i, k in enumerate(MISMATCH_KEYS):
        vals = [p[i].item() for p in parts]
        combined[k] = max(vals) if k in MISMATCH_MAX_KEYS else sum(vals)
    for k, v in mismatch_metrics(combined, prefix="").items():
        assert v == pytest.approx(got[k], rel=1e-12, abs=1e-12), k
    # the per-token ratio statistics by hand
    r = torch.exp(x["old"] - x["rollout"])[x["mask"] > 0]
    assert got["ratio_max"] == pytest.approx(r.max().item()) and got["ratio_min"] == pytest.approx(r.min().item())


def test_cispo_equals_verls(peers):
    x = peers[0]
    [(c, ref)] = _results(peers, "verl_cispo")
    logp = x["logp"].clone().requires_grad_(True)
    loss = aggregate(cispo_loss(logp, x["old"], x["adv"], c["eps"], c["eps_high"])[0], x["mask"], "token-mean")
    loss.backward()
    assert loss.item() == pytest.approx(ref["loss"].item(), rel=1e-12)
    assert torch.allclose(logp.grad, ref["grad"], **TOL)


def test_sapo_equals_verls_and_areals(peers):
    """verl aggregates SAPO seq-mean-token-mean (always), AReaL token-mean; the per-token loss is the same."""
    x = peers[0]
    cases = _results(peers, "verl_sapo") + _results(peers, "areal_sapo")
    assert len(cases) == 4
    for c, ref in cases:
        logp = x["logp"].clone().requires_grad_(True)
        mode = "seq-mean-token-mean" if c["fn"] == "verl_sapo" else "token-mean"
        loss = aggregate(sapo_loss(logp, x["old"], x["adv"], c["tau_pos"], c["tau_neg"]), x["mask"], mode)
        loss.backward()
        # 1e-6 (the acceptance bound): verl's per-sample means divide by (count + 1e-8)
        assert loss.item() == pytest.approx(ref["loss"].item(), rel=1e-6), c["fn"]
        assert torch.allclose(logp.grad, ref["grad"], rtol=1e-6, atol=1e-9), c["fn"]


def test_decoupled_ppo_is_areals(peers):
    """AReaL's decoupled PPO (clip against the proximal policy, times the behaviour weight pi_prox / pi_behav
    with its rejection sampling: action mask / clamp, level token / sequence = geometric mean) is --use-tis
    with --tis-mode mask / truncate and --tis-level token / geometric: the PPO ratio's old policy is the
    trainer's recomputed one (proximal), the weight's denominator the engine's (behaviour). Token-mean over the
    loss mask in both (a rejected token keeps its place in the denominator)."""
    x = peers[0]
    cases = _results(peers, "areal_decoupled_ppo")
    assert len(cases) == len(DECOUPLED_CASES)
    masked = []
    for c, ref in cases:
        logp = x["logp"].clone().requires_grad_(True)
        pg, _ = ppo_clip_loss(logp, x["old"], x["adv"], c["eps"], c["eps_high"])
        w = is_weights(x["old"], x["rollout"], x["mask"], "token" if c["level"] == "token" else "geometric",
                       "mask" if c["action"] == "mask" else "truncate", c["upper"], c["lower"])
        loss = aggregate(pg * w.weight, x["mask"], "token-mean")
        loss.backward()
        # 1e-6 (the acceptance bound): AReaL takes the behaviour log-ratio in float32 (.float()) on any input
        assert loss.item() == pytest.approx(ref["loss"].item(), rel=1e-6), c
        assert torch.allclose(logp.grad, ref["grad"], rtol=1e-6, atol=1e-9), c
        masked.append(w.out_of_bounds.sum().item())
    assert all(m > 0 for m in masked), masked  # every case has tokens out of the bounds
