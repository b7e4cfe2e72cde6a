"""Issue 5, trainer side: the algorithm flags (REINFORCE++ / -baseline token advantages with global
whitening, GSPO, dual clip, TIS, entropy bonus, KL loss) against float64 references.

Scenarios (algo_scenarios.py): "algo1" TP=1 DP=1 (4 micro-batches), "algo2" TP=1 DP=2 (rank r has
samples {2r, 2r+1}: its advantages equal the whole-batch whitened ones only if the whitening
moments are all-reduced). References: HF float64 + tests/algo/refs.py + algo_ref.py. Tolerances
(measured on 2 CPU cores in brackets):
  * gradients vs HF fp64: 1e-6 absolute + 1e-5 relative, as in test_trainer_megatron.py [3.5e-7];
  * token advantages vs refs.py: 1e-5 absolute [6e-7; whitened, O(1) values];
  * metric sums and metrics vs the reference: 1e-5 absolute (fp32 sums of 12 tokens) [< 1e-6],
    grad_norm 1e-4 relative; clip / TIS token counts exactly;
  * world 1 vs world 2 metrics: 1e-5 relative + 1e-6 absolute (same weights, other sum order);
  * vocab-parallel entropy at TP=2 vs full-vocab fp64: 1e-5 value, 1e-6 gradient [~1e-7].
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.algo import refs
from tests.trainer.algo_ref import ABLATION, CASES, reference_model, reference_step
from tests.trainer.algo_scenarios import entropy_inputs
from tests.trainer.test_trainer_megatron import _assert_grads_close
from tests.trainer.trainer_ref import hf_model, make_batch

WORLDS = {1: "algo1", 2: "algo2"}
MISMATCH = ("kl", "k3_kl", "training_log_ppl", "rollout_log_ppl", "training_ppl", "rollout_ppl", "log_ppl_diff",
            "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq",
            "ratio_mean", "ratio_max", "ratio_min")
BASE_METRICS = {"train/loss", "train/pg_loss", "train/kl", "train/ppo_kl", "train/entropy", "train/grad_norm",
                "train/rollout_logprob_abs_diff", "train/rollout_logprob_abs_diff_max", "train/pg_clipfrac",
                "train/pg_clipfrac_high", "train/pg_clipfrac_low", "train/advantage_mean", "train/advantage_std",
                "train/lr"}


def _full(recs: list[dict], key: str) -> list | None:
    """A per-sample record of every rank, back in global sample order."""
    if recs[0][key] is None:
        return None
    out: list = [None] * 4
    for rec in recs:
        for i, row in zip(rec["ids"], rec[key], strict=True):
            out[i] = row
    return out


@pytest.fixture(scope="session")
def algo_models(ckpts):
    model = hf_model(ckpts["qwen2"])
    return model, reference_model(model)


@pytest.fixture(scope="session")
def algo_expected(scenario, algo_models):
    """(world, case) -> reference of the perturbed-old gradient run, and of a train step (ratio 1)."""
    model, ref_model = algo_models
    batch, cache = make_batch(), {}

    def get(world: int, case: str) -> dict:
        if (world, case) not in cache:
            recs = scenario(WORLDS[world], world)
            kw, mode, perturb = CASES[case]
            old, rollout = _full(recs, f"{case}/old") if perturb else None, _full(recs, f"{case}/rollout")
            cache[world, case] = {
                "grad_run": reference_step(model, ref_model, batch, kw, mode, old, rollout),
                "ablated": reference_step(model, ref_model, batch, {**kw, **ABLATION[case]}, mode, old, rollout),
                "train_step": reference_step(model, ref_model, batch, kw, mode, None, rollout),
            }
        return cache[world, case]

    return get


def _stat_keys(kw: dict) -> list[str]:
    keys = ["pg", "clip_high", "clip_low", "k1_old_new", "tokens", "loss"]
    if kw.get("kl_coef", 0) > 0 or kw.get("use_kl_loss") or kw.get("kl_loss_coef", 0) > 0:
        keys.append("kl")
    if kw.get("entropy_coef", 0) > 0:
        keys.append("entropy_agg")
    if kw.get("use_tis"):
        keys += ["tis_w", "tis_clipped"]
    if kw.get("eps_clip_c") is not None:
        keys.append("clip_dual")
    return keys


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_gradient_and_sums_match_reference(scenario, algo_expected, world, case):
    recs = scenario(WORLDS[world], world)
    exp = algo_expected(world, case)
    want = exp["grad_run"]
    for rec in recs:  # every DP rank holds the whole DP-reduced gradient (gathered shards)
        _assert_grads_close(rec[f"{case}/grad"], want["grad"])
        stats = rec[f"{case}/stats"]
        for key in _stat_keys(CASES[case][0]):
            assert stats[key] == pytest.approx(want["sums"][key], abs=1e-5), (key, stats[key], want["sums"][key])
        assert stats["clipped"] == stats["clip_high"] + stats["clip_low"]
    # the feature matters on this batch: switching it off moves the gradient well past the tolerance
    off = exp["ablated"]["grad"]
    assert max(float((off[n] - g).abs().max()) for n, g in want["grad"].items()) > 1e-3


@pytest.mark.slow
def test_clipping_is_active_where_it_should_be(algo_expected):
    sums = {case: algo_expected(1, case)["grad_run"]["sums"]
            for case in ("dual_clip", "gspo", "tis", "mis_rs", "mis_helper")}
    assert sums["dual_clip"]["clip_high"] == 2 and sums["dual_clip"]["clip_low"] == 3
    assert sums["dual_clip"]["clip_dual"] == 3  # ratios 4.5, 3.7, 3.3 > c = 3 with A < 0
    assert sums["gspo"]["clip_high"] == 2  # sample 2 (2 tokens), s = 1.22 > 1.2
    assert 0 < sums["tis"]["tis_clipped"] < sums["tis"]["tokens"]
    # mis_rs (algo_ref.TIS_DELTA): samples 1 and 3 (4 + 3 tokens) out of the geometric bounds; sample 0 keeps two
    # tokens after the rejection at exp(0.05 / 3), sample 2 both at exp(-0.1)
    assert sums["mis_rs"]["tis_clipped"] == 7
    assert sums["mis_rs"]["tis_w"] == pytest.approx(2 * math.exp(0.05 / 3) + 2 * math.exp(-0.1), rel=1e-9)
    # mis_helper, log ratios OLD_DELTA - TIS_DELTA on trained tokens: sample 1 has -2.5 < -2 (vetoed); in [log 0.5,
    # log 2] stay -0.3 of sample 0, 0.6 of sample 2, -0.45 and 0.5 of sample 3; each over its sample's mean of e^x
    h = sums["mis_helper"]
    assert h["tis_clipped"] == 7  # trained tokens out of [0.5, 2]: 2 + 3 + 1 + 1
    mean0, mean2, mean3 = (sum(map(math.exp, xs)) / len(xs) for xs in ([-0.3, -0.95, 1.3], [0.6, -0.8],
                                                                        [-0.45, -0.7, 0.5]))
    assert h["tis_w"] == pytest.approx(math.exp(-0.3) / mean0 + math.exp(0.6) / mean2
                                       + (math.exp(-0.45) + math.exp(0.5)) / mean3, rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", ["rpp", "rpp_baseline"])
def test_token_advantages_whitened_over_the_global_batch(scenario, algo_expected, world, case):
    recs = scenario(WORLDS[world], world)
    got = _full(recs, f"{case}/advantages")
    want = algo_expected(world, case)["grad_run"]["advantages"]
    for g, w in zip(got, want, strict=True):
        assert max(abs(a - b) for a, b in zip(g, w, strict=True)) < 1e-5, (g, w)
    masks = make_batch()["loss_masks"]
    if world == 2:  # whitening each rank's half alone would give other numbers
        for rec in recs:
            ids = rec["ids"]
            local = refs.whiten([want[i] for i in ids], [masks[i] for i in ids])
            assert max(abs(a - b) for i, row in zip(ids, local, strict=True)
                       for a, b in zip(row, want[i], strict=True)) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_train_step_metrics(scenario, algo_expected, world, case):
    recs = scenario(WORLDS[world], world)
    kw = CASES[case][0]
    m = recs[0][f"{case}/metrics"]
    assert all(r[f"{case}/metrics"] == m for r in recs)  # identical on every rank
    keys = set(BASE_METRICS)
    if kw.get("entropy_coef", 0) > 0:
        keys.add("train/entropy_loss")
    if kw.get("use_tis"):
        keys |= {"train/tis_weight_mean", "train/tis_clipfrac"} | {f"train/rollout_corr/{k}" for k in MISMATCH}
    if kw.get("tis_mode") == "mask":
        keys.add("train/rollout_corr/is_masked_fraction")
    if kw.get("rollout_rs") or kw.get("rollout_rs_veto_threshold"):
        keys |= {"train/rollout_corr/rs_masked_fraction", "train/rollout_corr/rs_seq_masked_fraction"}
    if kw.get("rollout_rs_veto_threshold"):
        keys.add("train/rollout_corr/rs_veto_seq_fraction")
    if kw.get("tis_batch_normalize"):
        keys.add("train/rollout_corr/batch_norm_factor")
    if kw.get("eps_clip_c") is not None:
        keys.add("train/pg_clipfrac_dual")
    assert set(m) == keys and all(math.isfinite(v) for v in m.values())
    want = algo_expected(world, case)["train_step"]
    s = want["sums"]
    n = s["tokens"]
    assert m["train/loss"] == pytest.approx(want["loss"], abs=1e-5)
    assert m["train/pg_loss"] == pytest.approx(s["pg"] / n, abs=1e-5)
    assert m["train/entropy"] == pytest.approx(want["entropy_mean"], abs=1e-5)
    assert m["train/advantage_mean"] == pytest.approx(want["adv_mean"], abs=1e-5)
    assert m["train/advantage_std"] == pytest.approx(want["adv_std"], abs=1e-5)
    grad_norm = math.sqrt(sum(float(g.square().sum()) for g in want["grad"].values()))
    assert m["train/grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    # one mini-batch that starts at the old policy: ratio 1, nothing clipped, PPO-KL 0
    assert m["train/pg_clipfrac"] == m["train/pg_clipfrac_high"] == m["train/pg_clipfrac_low"] == 0.0
    assert m.get("train/pg_clipfrac_dual", 0.0) == 0.0
    assert abs(m["train/ppo_kl"]) < 1e-6
    if "kl" in _stat_keys(kw):
        assert m["train/kl"] == pytest.approx(s["kl"] / n, abs=1e-5) and m["train/kl"] > 1e-4
    if "train/entropy_loss" in m:
        assert m["train/entropy_loss"] == pytest.approx(s["entropy_agg"], abs=1e-5)
    if kw.get("use_tis"):
        assert m["train/tis_weight_mean"] == pytest.approx(s["tis_w"] / n, abs=1e-5)
        assert m["train/tis_clipfrac"] == s["tis_clipped"] / n
        # the mismatch metrics of the step (old = the policy itself here) against the engine's log-probs
        assert m["train/rollout_corr/kl"] == pytest.approx(want["mismatch_kl"], abs=1e-5)
        assert m["train/rollout_corr/ratio_max"] == pytest.approx(want["mismatch_ratio_max"], rel=1e-5)


@pytest.mark.slow
def test_metrics_same_under_dp2(scenario):
    (one,) = scenario("algo1", 1)
    two = scenario("algo2", 2)[0]
    for case in CASES:
        for key, value in one[f"{case}/metrics"].items():
            assert two[f"{case}/metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (case, key)


@pytest.mark.slow
def test_vocab_parallel_entropy_value_and_gradient_tp2(scenario):
    ranks = scenario("entropy_tp2", 2)
    logits, weights = entropy_inputs()
    full = (logits[..., :9].double() / 0.7).requires_grad_(True)  # vocab 9: id 9 is padding
    logp = torch.log_softmax(full, -1)
    h = -(logp.exp() * logp).sum(-1)
    (h * weights.double()).sum().backward()
    grad = torch.cat([full.grad / 0.7, torch.zeros(3, 4, 1, dtype=torch.float64)], dim=-1)  # d/d(logits)
    for rec in ranks:
        r = rec["rank"]
        assert torch.allclose(rec["entropy"].double(), h.detach(), atol=1e-5)
        assert torch.equal(rec["entropy"], rec["entropy_nograd"])
        assert torch.allclose(rec["grad"].double(), grad[..., r * 5 : (r + 1) * 5], atol=1e-6), r
    assert torch.equal(ranks[1]["grad"][..., -1], torch.zeros(3, 4))  # the padded id gets nothing


@pytest.mark.slow
def test_reference_refreshes_every_interval(scenario):
    """--ref-update-interval 2: rollouts 0-1 use the initial policy as reference, rollouts 2-3 the
    policy after rollout 1's update. The reference forward swaps weights in and out, so the
    log-probs of the same weights are bit-identical, and the policy moves every update."""
    (rec,) = scenario("ref_update", 1)
    old, ref = rec["old"], rec["ref"]
    assert ref[0] == old[0]  # reference = initial policy = rollout 0's policy
    assert ref[1] == old[0] and old[1] != old[0]  # still the initial policy; the policy moved
    assert ref[2] == old[2] and ref[2] != ref[1]  # refreshed after 2 updates: the policy of rollout 2
    assert ref[3] == old[2] and old[3] != old[2]


@pytest.mark.slow
def test_use_rollout_logprobs_takes_the_engines_log_probs_as_the_old_ones(scenario):
    """slime's --use-rollout-logprobs: with the engine's log-probs ROLLOUT_SHIFT above the trainer's own,
    train/ppo_kl (mean old - new over the step's tokens, at the step's starting weights) is that shift, where
    the trainer's own old log-probs give 0; the mismatch metric measures the trainer's own forward either way."""
    from tests.trainer.algo_scenarios import ROLLOUT_SHIFT

    (rec,) = scenario("rollout_logprobs", 1)
    engine, own = rec["engine_old"], rec["own_old"]
    assert engine["train/ppo_kl"] == pytest.approx(ROLLOUT_SHIFT, abs=1e-5)
    assert own["train/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    for m in (engine, own):
        assert m["train/rollout_logprob_abs_diff"] == pytest.approx(ROLLOUT_SHIFT, abs=1e-5)
        assert m["train/grad_norm"] > 0
    assert engine["train/loss"] != own["train/loss"]  # the ratio exp(new - old) is exp(-shift) there
