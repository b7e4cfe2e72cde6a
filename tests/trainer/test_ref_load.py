"""--ref-load: the KL reference from another checkpoint (HF folder, our Megatron checkpoint, a
Megatron-LM root), on two TP ranks. Expectations come from the HF models in float64: the
reference log-probs are the other model's, and train/kl is the token mean of low_var_kl between
the two models' log-probs; with the policy's own folder as the reference the KL is exactly 0."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import _load_tool, free_port
from tests.tools.test_convert_tools import run_tool
from tests.trainer.algo_ref import kl_est
from tests.trainer.ref_load_scenarios import OPD_COEF
from tests.trainer.trainer_ref import hf_logprobs, hf_model, make_batch, masked_token_mean
from tests.trainer.trainer_scenarios import run_scenario

pytestmark = pytest.mark.slow
TOL = 1e-5  # fp32 trainer vs float64 HF (as test_trainer_megatron's log-prob checks)


@pytest.fixture(scope="module")
def records(tiny_qwen2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref_load")
    make = _load_tool("make_tiny_model").make_tiny_model
    other = make(tmp / "other", arch="qwen2", seed=7)
    wider = make(tmp / "wider", arch="qwen2", seed=7, hidden_size=32)
    run_tool("convert_hf_to_megatron", ["--hf-checkpoint", str(other), "--save", str(tmp / "other_mcore")])
    # a Megatron-LM root: the tracker file and the dist_checkpointing folder, without our marker
    mlm = tmp / "other_mlm_root"
    shutil.copytree(tmp / "other_mcore", mlm)
    (mlm / "iter_0000000" / "slime_rl_checkpoint.json").unlink()
    ckpts = {"qwen2": tiny_qwen2, "other": other, "other_mcore": tmp / "other_mcore", "other_mlm_root": mlm,
             "wider": wider}
    return run_scenario("ref_load", 2, free_port(), tmp, ckpts), tiny_qwen2, other, run_scenario("opd", 2, free_port(),
                                                                                              tmp, ckpts)


def _close(got: list, want: list[torch.Tensor]) -> float:
    return max(float((torch.as_tensor(g, dtype=torch.float64) - w).abs().max()) for g, w in zip(got, want, strict=True))


def test_reference_from_another_checkpoint(records):
    ranks, policy, other, _ = records
    batch = make_batch()
    want_policy, want_ref = hf_logprobs(hf_model(policy), batch), hf_logprobs(hf_model(other), batch)
    want_kl = masked_token_mean([kl_est(p, r, "low_var_kl") for p, r in zip(want_policy, want_ref, strict=True)], batch)
    assert want_kl > 1e-3  # the two models differ: a reference that were the policy would fail below
    for rec in ranks:
        assert _close(rec["initial/policy_logp"], want_policy) < TOL
        for case in ("other_hf", "other_mcore", "other_mlm_root", "self_hf", "none", "wider"):
            # loading a reference (or failing to) leaves the policy exactly as built from --hf-checkpoint
            assert rec[f"{case}/policy_logp"] == rec["initial/policy_logp"], case
        for case in ("other_hf", "other_mcore", "other_mlm_root"):
            assert _close(rec[f"{case}/ref_logp"], want_ref) < TOL, case
            assert rec[f"{case}/kl"] == pytest.approx(want_kl, abs=TOL), case
        # the HF folder and its Megatron conversions are the same weights
        assert rec["other_mcore/ref_logp"] == rec["other_hf/ref_logp"] == rec["other_mlm_root/ref_logp"]
        assert rec["metrics"]["train/kl"] == pytest.approx(want_kl, abs=TOL)


def test_reference_equal_to_the_policy_gives_zero_kl(records):
    for rec in records[0]:
        for case in ("none", "self_hf"):
            assert rec[f"{case}/ref_logp"] == rec["initial/policy_logp"], case
            assert rec[f"{case}/kl"] == 0.0, case


def test_reference_of_another_shape_is_refused_naming_the_flag(records):
    for rec in records[0]:
        assert rec["wider/error"].startswith("--ref-load ") and "wider" in rec["wider/error"]


def test_on_policy_distillation_from_a_megatron_teacher(records):
    """--use-opd --opd-type megatron (slime's on-policy distillation), on two TP ranks with the teacher from our
    Megatron checkpoint of another tiny model: the teacher's log-probs are that model's (HF float64), the policy
    is exactly itself after the teacher's forward, each token's advantage is the sample's GRPO advantage less
    --opd-kl-coef x (policy - teacher log-prob), and train/opd_reverse_kl is the token mean of that gap."""
    _, policy, other, ranks = records
    batch = make_batch()
    want_policy, want_teacher = hf_logprobs(hf_model(policy), batch), hf_logprobs(hf_model(other), batch)
    gaps = [p - t for p, t in zip(want_policy, want_teacher, strict=True)]
    assert max(float(g.abs().max()) for g in gaps) > 1e-2  # the teacher is another model
    want_adv = [float(a) - OPD_COEF * g for a, g in zip(batch["advantages"], gaps, strict=True)]
    for rec in ranks:
        assert _close(rec["policy_logp"], want_policy) < TOL and _close(rec["teacher_logp"], want_teacher) < TOL
        assert rec["policy_logp_after_swap"] == rec["policy_logp"]
        assert _close(rec["old"], want_policy) < TOL
        assert _close(rec["advantages"], want_adv) < TOL
        assert rec["metrics"]["train/opd_reverse_kl"] == pytest.approx(masked_token_mean(gaps, batch), abs=TOL)
        # --opd-type sglang: the teacher's log-probs from the batch (its server's) give the same advantages
        served = [torch.tensor(a, dtype=torch.float64) for a in rec["advantages"]]
        assert _close(rec["served/advantages"], served) < 1e-9
