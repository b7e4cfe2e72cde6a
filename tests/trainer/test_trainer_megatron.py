"""The Megatron trainer against independent references, in spawned gloo processes.

Expected values come from HF transformers on the same folder in float64 (trainer_ref.py), from
the safetensors file itself, or from another parallel layout (TP=2 / DP=2 vs TP=1). Tolerances:
  * log-probs Megatron(fp32) vs HF(fp64): 1e-5 absolute (measured ~4e-7);
  * TP=2 vs TP=1 log-probs: 1e-5 absolute (measured ~5e-7; only reduction order differs);
  * gradients: 1e-6 absolute + 1e-5 relative vs HF fp64 (measured ~1e-7);
  * micro-batch size 1 vs 2: 1e-6 absolute (measured ~5e-8; padding and summation order differ);
  * bf16 vs fp32 HF log-probs: 0.02 absolute (measured 3e-3);
  * weights after one Adam step, DP=2 vs DP=1: 5e-6 absolute (ADAM_STEP_TOL; lr is 1e-3).
Micro-batches are packed (THD) by default, so every check here also covers packing.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.trainer_ref import make_batch, masked_token_mean

LOGP_TOL = 1e-5
ADAM_STEP_TOL = 5e-6  # see test_dp2_ranks_hold_identical_weights


def _max_diff(got: list[list[float]], want: list[torch.Tensor]) -> float:
    assert [len(g) for g in got] == [len(w) for w in want]
    return max(float((torch.tensor(g, dtype=torch.float64) - w).abs().max()) for g, w in zip(got, want, strict=True))


def _assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name].double()
        assert g.shape == w.shape, name
        assert torch.allclose(g, w, atol=1e-6, rtol=1e-5), (name, float((g - w).abs().max()))
    assert sum(float(w.abs().sum()) for w in want.values()) > 0  # the test is not vacuous


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_tp1_logprobs_match_hf(scenario, ref, family):
    (rec,) = scenario("tp1", 1)
    assert _max_diff(rec[f"{family}/logp"], ref[f"{family}/logp_t07"]) < LOGP_TOL


@pytest.mark.slow
def test_padded_vocab_never_changes_logprobs(scenario, ref):
    (rec,) = scenario("tp1", 1)
    assert rec["qwen2_pad/padded_vocab"] == 96  # 64 rounded up to a multiple of 48
    assert _max_diff(rec["qwen2_pad/logp"], ref["qwen2/logp_t07"]) < LOGP_TOL


@pytest.mark.slow
def test_tp2_logprobs_equal_tp1(scenario, ref):
    (tp1,) = scenario("tp1", 1)
    ranks = scenario("tp2", 2)
    assert sorted(r["tp_rank"] for r in ranks) == [0, 1]
    for rec in ranks:
        for family in ("qwen2", "llama", "qwen3"):
            want = [torch.tensor(x, dtype=torch.float64) for x in tp1[f"{family}/logp"]]
            assert _max_diff(rec[f"{family}/logp"], want) < 1e-5
            assert _max_diff(rec[f"{family}/logp"], ref[f"{family}/logp_t07"]) < LOGP_TOL


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_tp2_iter_hf_weights_bit_exact(scenario, ckpts, family):
    want = load_file(ckpts[family] / "model.safetensors")
    for rec in scenario("tp2", 2):
        got = rec[f"{family}/weights"]
        assert set(got) == set(want)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name


@pytest.mark.slow
def test_hf_weight_metadata_matches_weights(scenario):
    for rec in scenario("tp2", 2):
        meta = rec["qwen2/metadata"]
        assert [n for n, _, _ in meta] == list(rec["qwen2/weights"])  # same order as the iterator
        assert list(rec["qwen2/sources"]) == list(rec["qwen2/weights"])  # weight sync's iterator, TP=2
        assert all(torch.equal(t, rec["qwen2/weights"][n]) for n, t in rec["qwen2/sources"].items())
        for name, dtype, shape in meta:
            assert rec["qwen2/weights"][name].dtype == dtype and tuple(rec["qwen2/weights"][name].shape) == shape


@pytest.mark.slow
def test_gradient_matches_hf_and_ignores_micro_batch_size(scenario, ref):
    (rec,) = scenario("tp1", 1)
    for key in ("grad_mbs1", "grad_mbs2"):
        _assert_grads_close(rec[key], ref["grad"])
    for name, g in rec["grad_mbs1"].items():
        assert torch.allclose(g, rec["grad_mbs2"][name], atol=1e-6, rtol=0), name
    assert rec["stats_mbs1"]["tokens"] == rec["stats_mbs2"]["tokens"] == 12


@pytest.mark.slow
def test_tp2_gradient_matches_hf(scenario, ref):
    for rec in scenario("tp2", 2):
        _assert_grads_close(rec["grad"], ref["grad"])


@pytest.mark.slow
def test_train_step_metrics_and_update(scenario, ref):
    (rec,) = scenario("tp1", 1)
    m = rec["metrics"]
    batch = make_batch()
    grad_norm = math.sqrt(sum(float(g.square().sum()) for g in ref["grad"].values()))
    assert math.isfinite(m["train/grad_norm"]) and m["train/grad_norm"] > 0
    assert abs(m["train/grad_norm"] - grad_norm) < 1e-4 * grad_norm
    # train/loss is the weighted sum (loss_agg), pg_loss the token mean: equal up to fp32 rounding
    assert abs(m["train/loss"] - ref["loss"]) < 1e-6 and abs(m["train/pg_loss"] - m["train/loss"]) < 1e-6
    assert m["train/kl"] == 0.0 and m["train/pg_clipfrac"] == 0.0  # one mini-batch at ratio 1
    assert abs(m["train/entropy"] - ref["entropy_mean"]) < 1e-5
    rollout = [torch.tensor(x, dtype=torch.float64) for x in batch["rollout_logprobs"]]
    gaps = [(a - b).abs() for a, b in zip(ref["logp"], rollout, strict=True)]
    diff = masked_token_mean(gaps, batch)
    assert abs(m["train/rollout_logprob_abs_diff"] - diff) < 1e-5
    # the largest gap over trained tokens (the mask's part: tests/trainer/test_objective_stats.py)
    trained = [float(g[j]) for g, mask in zip(gaps, batch["loss_masks"], strict=True)
               for j, keep in enumerate(mask) if keep]
    assert abs(m["train/rollout_logprob_abs_diff_max"] - max(trained)) < 1e-5
    assert m["train/rollout_logprob_abs_diff_max"] > diff
    assert m["train/lr"] == pytest.approx(1e-3)
    changed = [n for n in rec["before"] if not torch.equal(rec["before"][n], rec["after"][n])]
    assert len(changed) == len(rec["before"])  # Adam moves every tensor that has a gradient


@pytest.mark.slow
def test_fused_old_logprobs_equal_the_separate_pass(scenario):
    """One optimizer step per rollout: the old log-probs taken from the training forward (default)
    and from a forward pass of their own (--separate-old-logprobs) give the same step."""
    (rec,) = scenario("tp1", 1)
    fused, separate = rec["metrics"], rec["separate/metrics"]
    assert set(fused) == set(separate)
    for key, value in separate.items():
        assert fused[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    # the fused ratio is exactly 1; the separate pass's is 1 up to fp32 rounding of two forwards
    assert fused["train/ppo_kl"] == 0.0 and fused["train/pg_clipfrac"] == 0.0
    for name, t in rec["after"].items():
        assert torch.allclose(t, rec["separate/after"][name], atol=ADAM_STEP_TOL), name


@pytest.mark.slow
def test_debug_train_data_holds_the_old_logprobs_of_either_path(scenario, ref):
    """--save-debug-train-data on the steps above: the fused path's log-probs, gathered back per
    sample from four micro-batches of the training forward, and the separate pass's, both the HF
    float64 log-probs of the initial weights; the rest is the batch as given."""
    (rec,) = scenario("tp1", 1)
    batch = make_batch()
    for key, source in (("dump/fused", "training forward (fused)"), ("dump/separate", "separate forward pass")):
        dump = rec[key]
        assert (dump["rollout_id"], dump["rank"], dump["dp_size"], dump["log_probs_from"]) == (5, 0, 1, source)
        assert _max_diff([s["log_probs"] for s in dump["samples"]], ref["logp"]) < LOGP_TOL
        for i, s in enumerate(dump["samples"]):
            n = batch["response_lengths"][i]
            assert s["tokens"] == batch["tokens"][i] and s["response_ids"] == batch["tokens"][i][-n:]
            assert s["rollout_log_probs"] == batch["rollout_logprobs"][i] and s["loss_mask"] == batch["loss_masks"][i]
            assert s["advantages"] == [batch["advantages"][i]] * n and s["reward"] == batch["rewards"][i]


@pytest.mark.slow
def test_metrics_same_under_tp2_and_dp2(scenario):
    (tp1,) = scenario("tp1", 1)
    for name, world in (("tp2", 2), ("dp2", 2)):
        ranks = scenario(name, world)
        assert ranks[0]["metrics"] == ranks[1]["metrics"]  # identical on every rank
        for key, value in tp1["metrics"].items():
            assert ranks[0]["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)


@pytest.mark.slow
def test_dp2_ranks_hold_identical_weights(scenario):
    r0, r1 = scenario("dp2", 2)
    assert {r0["dp_rank"], r1["dp_rank"]} == {0, 1} and r0["dp_size"] == 2
    (tp1,) = scenario("tp1", 1)
    for name, t in r0["after"].items():
        assert torch.equal(t, r1["after"][name]), name
        # Adam's first step is lr * g / (|g| + eps) ~ lr * sign(g): equal to the single-rank update
        # up to rounding, except that for |g| near eps = 1e-8 the fp32 rounding of g (another
        # summation order) moves it by ~1e-6 (measured 1.03e-6 on one element); a wrong or
        # missing gradient moves updates by ~lr = 1e-3
        assert torch.allclose(t, tp1["after"][name], atol=ADAM_STEP_TOL), name


@pytest.mark.slow
def test_reference_model_kl(scenario):
    (rec,) = scenario("tp1", 1)
    m = rec["kl/metrics"]
    # two mini-batches: the second runs after one update, so it differs from the reference
    assert m["train/kl"] > 0 and math.isfinite(m["train/loss"])
    # train/loss is the fp32 weighted sum of pg + 0.1 * kl (loss_agg), the others fp64 token means
    assert m["train/loss"] == pytest.approx(m["train/pg_loss"] + 0.1 * m["train/kl"], rel=1e-6)
    assert rec["kl/ref_logp"] == rec["kl/initial_logp"]  # the frozen copy is the initial model
    for name, t in rec["kl/trained"].items():
        assert torch.equal(t, rec["kl/restored"][name]), name  # swapped back exactly
    assert any(not torch.equal(rec["kl/trained"][n], rec["before"][n]) for n in rec["before"])


@pytest.mark.slow
def test_bf16_smoke(scenario, ref):
    """bf16 params (Float16Module, fp32 main params in the optimizer): log-probs near the fp32 ones
    (bf16 has ~3 significant digits; measured 3e-3 on log-probs) and a finite step."""
    (rec,) = scenario("tp1", 1)
    assert _max_diff(rec["bf16/logp"], ref["qwen2/logp_t07"]) < 0.02
    assert all(math.isfinite(v) for v in rec["bf16/metrics"].values())
    assert rec["bf16/metrics"]["train/grad_norm"] > 0
    assert rec["bf16/dtypes"] == ["torch.bfloat16"]
    assert rec["bf16/views_reused"] and rec["bf16/views_current"]  # weight sync's cache after a real step
