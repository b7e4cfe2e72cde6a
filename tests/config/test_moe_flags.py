"""The mixture-of-experts flags (Megatron's names) are parsed into the config groups and checked
against the checkpoint in preflight, before any actor starts, with errors that name the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime_rl.config import ConfigError, build_config
from slime_rl.config.checks import ConfigNote
from slime_rl.train import check_model_features


def _cfg(model, *extra: str):
    data = Path(model) / "prompts.jsonl"  # never read here
    data.write_text('{"problem": "1", "answer": "1"}\n')
    return build_config(["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rollout-batch-size", "4",
                         "--global-batch-size", "4", "--num-rollout", "1", "--rm-type", "digit", *extra])


def test_moe_flags_reach_the_groups(tiny_qwen3_moe):
    cfg = _cfg(tiny_qwen3_moe, "--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2",
               "--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type", "seq_aux_loss",
               "--moe-token-dispatcher-type", "allgather")
    assert cfg.parallel.expert_model_parallel_size == 2 and cfg.parallel.expert_tensor_parallel_size is None
    t = cfg.trainer
    assert (t.moe_aux_loss_coeff, t.moe_router_load_balancing_type, t.moe_token_dispatcher_type) == (
        0.01, "seq_aux_loss", "allgather")
    check_model_features(cfg)  # 8 experts over 2 ranks: accepted
    default = _cfg(tiny_qwen3_moe).trainer
    assert (default.moe_aux_loss_coeff, default.moe_token_dispatcher_type) == (0.0, "alltoall")


def test_grouped_gemm_is_the_trainers_grouped_experts(tiny_qwen3_moe):
    """slime's MoE model files all pass --moe-grouped-gemm: the trainer then runs the local experts as grouped
    products (trainer/experts.py; equal to SequentialMLP: tests/trainer/test_moe.py); not a MODEL_ARGS flag."""
    cfg = _cfg(tiny_qwen3_moe, "--moe-grouped-gemm")
    check_model_features(cfg)
    assert cfg.trainer.moe_grouped_gemm and not _cfg(tiny_qwen3_moe).trainer.moe_grouped_gemm
    assert "--moe-grouped-gemm" not in cfg.model.megatron_model_args


def test_expert_parallel_must_divide_the_world(tiny_qwen3_moe):
    with pytest.raises(ConfigError, match="--expert-model-parallel-size \\(4\\).*world size 2"):
        _cfg(tiny_qwen3_moe, "--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "4")
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size \\(2\\)"):
        _cfg(tiny_qwen3_moe, "--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2",
             "--expert-tensor-parallel-size", "2")


@pytest.mark.parametrize("extra,match", [
    (("--actor-num-gpus-per-node", "3", "--expert-model-parallel-size", "3", "--rollout-batch-size", "3",
      "--global-batch-size", "3"), "3: .* has 8 experts"),
    (("--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2"), "needs --sequence-parallel"),
    (("--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2", "--moe-token-dispatcher-type",
      "allgather"), "--moe-token-dispatcher-type allgather"),
    (("--actor-num-gpus-per-node", "4", "--expert-model-parallel-size", "2", "--context-parallel-size", "2",
      "--moe-token-dispatcher-type", "allgather"), "allgather with --context-parallel-size 2"),
    (("--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2", "--no-pack-sequences",
      "--moe-token-dispatcher-type", "allgather"), "allgather with --no-pack-sequences"),
])
def test_moe_flags_checked_against_the_checkpoint(tiny_qwen3_moe, extra, match):
    with pytest.raises(ConfigError, match=match):
        check_model_features(_cfg(tiny_qwen3_moe, *extra))


def test_expert_parallel_refused_for_a_dense_model(tiny_qwen2):
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 2.*dense model \\('qwen2'\\)"):
        check_model_features(_cfg(tiny_qwen2, "--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2"))


def test_unknown_dispatcher_refused(tiny_qwen3_moe):
    with pytest.raises((ConfigError, SystemExit)):
        _cfg(tiny_qwen3_moe, "--moe-token-dispatcher-type", "deepep")


def test_slimes_flex_dispatcher_runs_as_alltoall_with_a_note(tiny_qwen3_moe):
    """slime's MoE scripts: --moe-token-dispatcher-type flex --moe-enable-deepep. The flex dispatcher is DeepEP's
    transport for the same routing: here alltoall, said once."""
    with pytest.warns(ConfigNote, match="flex dispatcher needs DeepEP"):
        cfg = _cfg(tiny_qwen3_moe, "--moe-token-dispatcher-type", "flex", "--moe-enable-deepep")
    assert cfg.trainer.moe_token_dispatcher_type == "alltoall"
