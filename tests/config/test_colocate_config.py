"""--colocate: the flag's defaults, the combinations it refuses (each error names the flags), and the
placement it gives (engines inside the trainer's bundles, half a GPU each)."""

from __future__ import annotations

import pytest

from slime_rl.config import ConfigError, EngineConfig, ParallelConfig, build_config
from slime_rl.orchestration.placement import PlacementError, assign_devices, engine_device, plan_placement, rank_coords

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


def test_engines_of_two_gpus_on_one_node_each_beside_two_trainer_ranks():
    """slime's scripts/run-qwen3-4B.sh layout: 8 GPUs, TP-2 trainer, --colocate, --rollout-num-gpus-per-engine 2:
    engine e runs beside trainer ranks 2e and 2e+1, its TP rank i on rank 2e+i's GPU."""
    plan = plan_placement(ParallelConfig(2, 1, 1, 8), EngineConfig(num_gpus=8, num_gpus_per_engine=2, colocate=True),
                          cluster_gpus=8)
    assert [e.bundles for e in plan.engines] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # an engine's actor in its first bundle (two CPU slots there), half a GPU each; no GPU beyond the trainer's 8
    assert plan.bundles == ({"GPU": 1.0, "CPU": 2.0}, {"GPU": 1.0, "CPU": 1.0}) * 4
    assert plan.actor_gpu == 0.5 and [plan.engine_actor_gpu(e) for e in plan.engines] == [0.5] * 4
    devices = assign_devices(plan, 1, 8)
    assert [str(engine_device(plan, devices, e)) for e in plan.engines] == [
        "node 0 GPU 0,1", "node 0 GPU 2,3", "node 0 GPU 4,5", "node 0 GPU 6,7"]
    assert [str(devices[b]) for b in plan.trainer_bundles] == [f"node 0 GPU {g}" for g in range(8)]
    assert "engine 3 -> bundles [6, 7] (TP 2: TP rank i beside trainer rank 6+i)" in plan.describe()
    # fewer engine GPUs than the trainer's: the first ranks hold engines, the others none
    half = plan_placement(ParallelConfig(2, 1, 1, 8), EngineConfig(num_gpus=4, num_gpus_per_engine=2, colocate=True),
                          cluster_gpus=8)
    assert [e.bundles for e in half.engines] == [(0, 1), (2, 3)]
    assert [b["CPU"] for b in half.bundles] == [2.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_engines_of_four_gpus_on_two_nodes_and_one_that_would_span_them():
    plan = plan_placement(ParallelConfig(4, 1, 2, 8), EngineConfig(num_gpus=16, num_gpus_per_engine=4, colocate=True),
                          cluster_gpus=16)
    devices = assign_devices(plan, 2, 8)
    assert [str(engine_device(plan, devices, e)) for e in plan.engines] == [
        "node 0 GPU 0,1,2,3", "node 0 GPU 4,5,6,7", "node 1 GPU 0,1,2,3", "node 1 GPU 4,5,6,7"]
    # 6 GPUs per node: engine 1 (ranks 4..7) would have GPUs 4,5 of node 0 and 0,1 of node 1
    wide = plan_placement(ParallelConfig(2, 1, 2, 6), EngineConfig(num_gpus=12, num_gpus_per_engine=4, colocate=True),
                          cluster_gpus=12)
    with pytest.raises(PlacementError, match=r"--cluster 2x6: colocated engine 1 runs beside trainer ranks 4\.\.7, "
                                             r"which span nodes 0 and 1; .*--rollout-num-gpus-per-engine 4"):
        assign_devices(wide, 2, 6)


def test_pipeline_stages_each_hold_engines():
    """PP 2, TP 2 on 8 GPUs (Megatron's order: ranks 0-3 are stage 0, 4-7 stage 1): engines 2 and 3 run
    beside stage-1 ranks, which get stage 0's layers by the sync's PP broadcast."""
    parallel = ParallelConfig(2, 2, 1, 8)
    plan = plan_placement(parallel, EngineConfig(num_gpus=8, num_gpus_per_engine=2, colocate=True), cluster_gpus=8)
    assert [[rank_coords(r, parallel)["pp"] for r in e.bundles] for e in plan.engines] == [[0, 0], [0, 0], [1, 1],
                                                                                            [1, 1]]
