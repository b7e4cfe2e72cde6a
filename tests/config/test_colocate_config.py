"""--colocate: the flag's defaults, the combinations it refuses (each error names the flags), and the
placement it gives (engines inside the trainer's bundles, half a GPU each)."""

from __future__ import annotations

import pytest

from slime_rl.config import ConfigError, EngineConfig, ParallelConfig, build_config
from slime_rl.orchestration.placement import PlacementError, plan_placement

BASE = ["--hf-checkpoint", "m", "--prompt-data", "d.jsonl", "--rollout-batch-size", "4", "--num-rollout", "2",
        "--rm-type", "digit", "--actor-num-gpus-per-node", "2", "--micro-batch-size", "1"]


def cfg(*extra: str):
    return build_config(BASE + list(extra), check_paths=False)


def test_rollout_num_gpus_defaults_to_the_trainers_devices():
    assert cfg().engine.num_gpus == 1 and not cfg().engine.colocate
    c = cfg("--colocate")
    assert c.engine.colocate and c.engine.num_gpus == 2  # actor-num-nodes x actor-num-gpus-per-node
    assert cfg("--colocate", "--rollout-num-gpus", "1").engine.num_gpus == 1


@pytest.mark.parametrize(("extra", "message"), [
    (["--rollout-num-gpus", "4"], "--rollout-num-gpus \\(4\\) must be at most"),
    (["--rollout-num-gpus-per-engine", "2"], "--rollout-num-gpus-per-engine 1"),
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size 1"),
    (["--async"], "--colocate and --async exclude each other"),
    (["--use-fault-tolerance"], "--colocate does not support --use-fault-tolerance"),
    (["--use-sglang-router"], "--colocate does not support --use-sglang-router"),
    (["--update-weights-interval", "2"], "--update-weights-interval 1"),
])
def test_refused_combinations_name_the_flags(extra, message):
    with pytest.raises(ConfigError, match=message):
        cfg("--colocate", *extra)


def test_placement_shares_the_trainer_bundles():
    parallel = ParallelConfig(actor_num_gpus_per_node=2)
    gpu = plan_placement(parallel, EngineConfig(num_gpus=2, colocate=True), cluster_gpus=2)
    assert gpu.colocated and gpu.actor_gpu == 0.5
    assert gpu.bundles == ({"GPU": 1.0, "CPU": 2.0},) * 2  # a trainer rank and an engine in each
    assert gpu.trainer_bundles == (0, 1) and [e.bundles for e in gpu.engines] == [(0,), (1,)]
    one = plan_placement(parallel, EngineConfig(num_gpus=1, colocate=True), cluster_gpus=0, cluster_cpus=2)
    assert one.actor_gpu == 0.0 and one.bundles == ({"CPU": 2.0}, {"CPU": 1.0})  # rank 1's bundle has no engine
    assert "colocated" in one.describe()
    with pytest.raises(PlacementError, match="--colocate"):
        plan_placement(parallel, EngineConfig(num_gpus=3, colocate=True), cluster_gpus=4)
    # disaggregated on the same cluster needs 4 GPUs, colocated fits 2
    with pytest.raises(PlacementError):
        plan_placement(parallel, EngineConfig(num_gpus=2), cluster_gpus=2)
