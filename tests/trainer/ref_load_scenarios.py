"""--ref-load scenarios (run by tests/trainer/test_ref_load.py through trainer_scenarios.run_scenario).

The policy is the tiny Qwen2 `qwen2`; the reference comes from `other` (another tiny Qwen2, other
seed) as an HF folder, as our Megatron checkpoint of it (tools/convert_hf_to_megatron.py) and as a
Megatron-LM-style root (tracker file, no slime_rl marker), or from the policy's own folder.
"""

from __future__ import annotations

import dataclasses

from slime_rl.config.groups import AlgoConfig, BatchConfig, ModelConfig, OptimizerConfig, ParallelConfig
from tests.trainer.trainer_ref import make_batch

KL = {"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl"}


def _worker(rank: int, world: int, port: int, policy: str, ref_load: str | None):
    from slime_rl.trainer.worker import TrainerWorker

    return TrainerWorker(rank, world, "127.0.0.1", port,
                         ParallelConfig(tensor_model_parallel_size=world, actor_num_gpus_per_node=world),
                         BatchConfig(micro_batch_size=2, global_batch_size=4),
                         OptimizerConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.0, lr_decay_style="constant"),
                         ModelConfig(hf_checkpoint=policy, ref_load=ref_load), AlgoConfig(**KL), train_iters=10)


def _ref_and_kl(w, batch: dict) -> tuple[list, float]:
    """The reference log-probs a step uses and its KL token mean (forward and backward only: the
    weights do not move, so every case sees the initial policy)."""
    inputs = w.step_inputs(batch)
    stats = w.forward_backward(batch, inputs.old, inputs.ref)
    return inputs.ref, stats["kl"] / stats["tokens"]


def scenario_ref_load(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    """One policy rank, the reference loaded from each source in turn (the constructor's path for the
    first, `_load_reference` for the others): the policy's log-probs after each load, the reference
    log-probs and the KL token mean; then a real train step (train/kl) with the HF reference."""
    batch = make_batch()
    res: dict = {}
    w = _worker(rank, world, port, ckpts["qwen2"], ckpts["other"])
    res["initial/policy_logp"] = w.compute_logprobs(batch)
    for case in ("other_hf", "other_mcore", "other_mlm_root", "self_hf", "none"):
        if case == "none":
            w._refresh_reference()  # the default: the policy as built
        elif case != "other_hf":
            w._load_reference(ckpts["qwen2" if case == "self_hf" else case])
        res[f"{case}/ref_logp"], res[f"{case}/kl"] = _ref_and_kl(w, batch)
        res[f"{case}/policy_logp"] = w.compute_logprobs(batch)
    try:  # a reference of another shape: refused, naming the flag; the policy is untouched
        w._load_reference(ckpts["wider"])
    except ValueError as e:
        res["wider/error"] = str(e)
    res["wider/policy_logp"] = w.compute_logprobs(batch)
    w._load_reference(ckpts["other"])
    res["metrics"] = w.train_step(batch)  # one mini-batch: its forward sees the initial policy
    w.shutdown()
    return res


OPD_COEF = 0.5


def scenario_opd(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    """--use-opd --opd-type megatron with the teacher from our Megatron checkpoint of `other`: the policy's and
    the teacher's log-probs, the step's per-token advantages, then a train step's metrics."""
    from slime_rl.trainer.worker import TrainerWorker

    batch = make_batch()
    w = TrainerWorker(rank, world, "127.0.0.1", port,
                      ParallelConfig(tensor_model_parallel_size=world, actor_num_gpus_per_node=world),
                      BatchConfig(micro_batch_size=2, global_batch_size=4),
                      OptimizerConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.0, lr_decay_style="constant"),
                      ModelConfig(hf_checkpoint=ckpts["qwen2"], opd_teacher_load=ckpts["other_mcore"]),
                      AlgoConfig(use_opd=True, opd_type="megatron", opd_kl_coef=OPD_COEF), train_iters=10)
    res: dict = {"policy_logp": w.compute_logprobs(batch)}
    with w._swapped(w._teacher):
        res["teacher_logp"] = w.compute_logprobs(batch)
    res["policy_logp_after_swap"] = w.compute_logprobs(batch)
    inputs = w.step_inputs(batch)
    res["old"], res["advantages"] = inputs.old, inputs.advantages
    # --opd-type sglang: the same teacher's log-probs arriving with the batch (from the teacher's server) instead of
    # the teacher's forward here
    w.algo = dataclasses.replace(w.algo, opd_type="sglang")
    served = dict(batch, teacher_logprobs=[[float(x) for x in row] for row in res["teacher_logp"]])
    res["served/advantages"] = w.step_inputs(served).advantages
    w.algo = dataclasses.replace(w.algo, opd_type="megatron")
    res["metrics"] = w.train_step(batch)
    w.shutdown()
    return res


SCENARIOS = {"ref_load": scenario_ref_load, "opd": scenario_opd}
