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
    plan = plan_placement(ParallelConfig(2, 1, 1, 2), EngineConfig(num_gpus=4, num_gpus_per_engine=2), cluster_gpus=8)
    assert [(e.bundles, e.rank_offset) for e in plan.engines] == [((2, 3), 1), ((4, 5), 3)]
    assert plan.weight_update_world_size == 5
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
