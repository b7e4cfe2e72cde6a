import pytest

from slime_rl.config import EngineConfig, ParallelConfig
from slime_rl.orchestration.buffer import StepBuffer
from slime_rl.orchestration.placement import PlacementError, dp_shard, plan_placement


def test_plan_cpu_quickstart_layout():
    plan = plan_placement(ParallelConfig(2, 1, 1, 2), EngineConfig(num_gpus=1), cluster_gpus=0, cluster_cpus=2)
    assert plan.trainer_bundles == (0, 1)
    assert [e.bundles for e in plan.engines] == [(2,)]
    assert plan.weight_update_world_size == 2
    assert all(b == {"CPU": 1.0} for b in plan.bundles)
    assert "share cores" in plan.describe()


def test_plan_gpu_engines_rank_offsets_and_shortage():
    # SGLang --tp-size 2 needs both GPUs visible to one process: one bundle of 2 GPUs per engine, and
    # the engine's actor asks for both; weight-update ranks: trainer 0, engine 0 -> 1,2, engine 1 -> 3,4
    plan = plan_placement(ParallelConfig(2, 1, 1, 2), EngineConfig(num_gpus=4, num_gpus_per_engine=2), cluster_gpus=8)
    assert [(e.bundles, e.rank_offset, e.num_gpus) for e in plan.engines] == [((2,), 1, 2), ((3,), 3, 2)]
    assert plan.bundles == ({"GPU": 1.0, "CPU": 1.0},) * 2 + ({"GPU": 2.0, "CPU": 1.0},) * 2
    assert sum(b.get("GPU", 0) for b in plan.bundles) == 6  # 2 trainer + 4 engine GPUs, none twice
    assert [plan.engine_actor_gpu(e) for e in plan.engines] == [2.0, 2.0]
    assert plan.weight_update_world_size == 5
    assert "engine 1 -> bundles [3] (2 devices: TP 2), weight-update rank_offset 3" in plan.describe()
    one = plan_placement(ParallelConfig(1, 1, 1, 1), EngineConfig(num_gpus=1), cluster_gpus=2)
    assert one.engine_actor_gpu(one.engines[0]) == 1.0 and one.weight_update_world_size == 2
    with pytest.raises(PlacementError, match=r"--rollout-num-gpus-per-engine \(2\) must divide "
                                             r"--rollout-num-gpus \(3\)"):
        plan_placement(ParallelConfig(2, 1, 1, 4), EngineConfig(num_gpus=3, num_gpus_per_engine=2, colocate=True),
                       cluster_gpus=4)
    with pytest.raises(PlacementError, match="--rollout-num-gpus"):
        plan_placement(ParallelConfig(2, 1, 1, 2), EngineConfig(num_gpus=4), cluster_gpus=4)


def test_dp_shard_covers_each_minibatch_once():
    n, gbs, dp = 12, 6, 3
    shards = [dp_shard(n, gbs, r, dp) for r in range(dp)]
    assert sorted(i for s in shards for i in s) == list(range(n))
    # the k-th local mini-batch of every rank lies inside global mini-batch k
    for s in shards:
        for k in range(n // gbs):
            assert all(k * gbs <= i < (k + 1) * gbs for i in s[k * 2:(k + 1) * 2])


def test_buffer_waits_for_all_readers():
    buf = StepBuffer()
    buf.put(0, {"x": [1]})
    assert buf.get(0, readers=2) == {"x": [1]}
    assert buf.steps() == [0]
    buf.get(0, readers=2)
    assert buf.steps() == []
    with pytest.raises(KeyError):
        buf.get(0)


def test_buffer_rows_from_ranks_join_the_batch_and_count_as_reads():
    # PPO's order: 2 critic shards put values, one policy rank reads the batch with them and puts
    # its returns, the critic ranks read their own returns; 1 + 1 + 2 reads delete the step
    buf = StepBuffer()
    buf.put(3, {"tokens": [[1], [2], [3], [4]]})
    buf.get(3, readers=4)  # the critic ranks' first read (one of them here)
    buf.put_rows(3, "values", [2, 3], [[0.3], [0.4]])
    with pytest.raises(AssertionError, match=r"no 'values' rows for samples \[0, 1\]"):
        buf.get_rows(3, "values", [0, 1, 2], readers=99)  # read before the other shard wrote: refused
    buf.put_rows(3, "values", [0, 1], [[0.1], [0.2]])
    batch = buf.get(3, readers=4)
    assert batch["values"] == [[0.1], [0.2], [0.3], [0.4]] and batch["tokens"][0] == [1]
    buf.put_rows(3, "returns", [0, 1, 2, 3], [[1.0], [2.0], [3.0], [4.0]])
    assert buf.get_rows(3, "returns", [1, 3], readers=4) == [[2.0], [4.0]]
    assert buf.steps() == [3]
    assert buf.get_rows(3, "returns", [0, 2], readers=4) == [[1.0], [3.0]]
    assert buf.steps() == []
