"""Engines over several nodes (--rollout-num-gpus-per-engine N above a node's G GPUs), as slime's scripts for
DeepSeek-R1 (colocated, 64 GPUs per engine on 16x8), GLM-4.7-355B, Kimi-K2 and Qwen3-235B (disaggregated, 32 per
engine) run them: N/G node parts, each on its own whole node, SGLang's --nnodes/--node-rank/--dist-init-addr."""

from __future__ import annotations

import argparse

import pytest

from slime_rl.config import build_config
from slime_rl.config.groups import ParallelConfig
from slime_rl.config.groups_rollout import EngineConfig
from slime_rl.orchestration.cluster import colocated_visible_devices
from slime_rl.orchestration.engines import engine_command
from slime_rl.orchestration.nodes import gpu_shape
from slime_rl.orchestration.placement import PlacementError, assign_devices, engine_devices, plan_placement


def _cfg(model, tmp_path, *extra):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "1", "label": "1"}\n')
    return build_config(["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type", "digit",
                         "--rollout-batch-size", "8", "--num-rollout", "1", "--rollout-backend", "sglang",
                         "--rollout-num-gpus", "16", "--rollout-num-gpus-per-engine", "16",
                         "--actor-num-gpus-per-node", "8", *extra])


def _engine(**kw) -> EngineConfig:
    return EngineConfig(**{"backend": "sglang", **kw})


def test_a_disaggregated_engine_of_two_nodes_holds_one_bundle_of_a_whole_node_on_each():
    # trainer TP 8 on node 0; two engines of 16 GPUs on nodes of 8: nodes 1-2 and 3-4
    plan = plan_placement(ParallelConfig(8, 1, 1, 8), _engine(num_gpus=32, num_gpus_per_engine=16),
                          cluster_gpus=40, gpus_per_node=8)
    assert [(e.bundles, e.nodes, e.gpus_per_node) for e in plan.engines] == [((8, 9), 2, 8), ((10, 11), 2, 8)]
    assert [e.part(1) for e in plan.engines] == [(9,), (11,)]
    assert plan.bundles[8:] == ({"GPU": 8.0, "CPU": 1.0},) * 4 and len(plan.bundles) == 12
    assert [plan.engine_actor_gpu(e) for e in plan.engines] == [8.0, 8.0]  # one node part's GPUs per actor
    # the weight-update group still counts every engine GPU once: trainer source + 2 x 16
    assert [e.rank_offset for e in plan.engines] == [1, 17] and plan.weight_update_world_size == 33
    devices = assign_devices(plan, 5, 8)
    parts = [[str(d) for d in engine_devices(plan, devices, e)] for e in plan.engines]
    full = ",".join(map(str, range(8)))
    assert parts == [[f"node 1 GPU {full}", f"node 2 GPU {full}"], [f"node 3 GPU {full}", f"node 4 GPU {full}"]]
    assert "over 2 nodes of 8 GPUs" in plan.describe()
    with pytest.raises(PlacementError, match="engine 1 needs 2 nodes of 8 GPUs each"):
        assign_devices(plan, 4, 8)  # 32 GPUs: engine 1's parts find one node, not two


def test_a_colocated_engine_of_sixteen_gpus_runs_beside_the_trainer_ranks_of_two_whole_nodes():
    plan = plan_placement(ParallelConfig(8, 1, 4, 8), _engine(num_gpus=32, num_gpus_per_engine=16, colocate=True),
                          cluster_gpus=32, gpus_per_node=8)
    e0, e1 = plan.engines
    assert (e0.bundles, e0.part(0), e0.part(1)) == (tuple(range(16)), tuple(range(8)), tuple(range(8, 16)))
    assert e1.part(1) == tuple(range(24, 32))
    # an actor of each node part in the part's first bundle: two CPU slots there
    assert [i for i, b in enumerate(plan.bundles) if b["CPU"] == 2.0] == [0, 8, 16, 24]
    devices = assign_devices(plan, 4, 8)
    assert [d.node for e in plan.engines for d in engine_devices(plan, devices, e)] == [0, 1, 2, 3]
    # each part's CUDA_VISIBLE_DEVICES: the GPUs of the trainer ranks beside it, in TP order
    ranks = [(f"10.0.0.{r // 8}", str(r % 8)) for r in range(32)]
    visible = colocated_visible_devices(plan, ranks)
    assert visible == {(e, k): "0,1,2,3,4,5,6,7" for e in (0, 1) for k in (0, 1)}
    # a node part whose ranks are on two nodes is named
    shifted = [(f"10.0.0.{(r + 4) // 8}", str((r + 4) % 8)) for r in range(32)]
    with pytest.raises(RuntimeError, match="node part 0 of engine 0 runs beside trainer ranks on nodes"):
        colocated_visible_devices(plan, shifted)


def test_engines_that_cannot_span_nodes_are_refused_naming_the_flag():
    with pytest.raises(PlacementError, match=r"--rollout-num-gpus-per-engine 12 is more than a node's 8 GPUs and not "
                                             r"a multiple of them.*give 8 or 16"):
        plan_placement(ParallelConfig(1, 1, 1, 8), _engine(num_gpus=24, num_gpus_per_engine=12), cluster_gpus=40,
                       gpus_per_node=8)
    with pytest.raises(PlacementError, match="only SGLang runs one engine over several nodes"):
        builtin = EngineConfig(backend="embedded", num_gpus=16, num_gpus_per_engine=16)
        plan_placement(ParallelConfig(1, 1, 1, 8), builtin, cluster_gpus=32, gpus_per_node=8)
    # nodes of unknown size (a CPU plan, or no node size given): one node, as before
    one = plan_placement(ParallelConfig(1, 1, 1, 8), _engine(num_gpus=16, num_gpus_per_engine=16), cluster_gpus=24)
    assert one.engines[0].nodes == 1 and one.bundles[-1]["GPU"] == 16.0


def test_the_node_parts_launch_as_sglang_reads_them(tiny_qwen2, tmp_path):
    """Each part's command parsed by SGLang 0.5.23's own ServerArgs parser: one TP group of 16 over 2 nodes,
    meeting at node part 0's address."""
    server_args = pytest.importorskip("sglang.srt.server_args")
    cfg = _cfg(tiny_qwen2, tmp_path)
    plan = plan_placement(cfg.parallel, cfg.engine, cluster_gpus=24, gpus_per_node=8)
    slot = plan.engines[0]
    parser = argparse.ArgumentParser(add_help=False)
    server_args.ServerArgs.add_cli_args(parser)
    parsed = []
    for k, host in enumerate(("10.0.0.2", "10.0.0.3")):
        argv = engine_command(cfg, slot, host, 31000 + k, None, use_gpu=True, node_rank=k,
                              dist_init_addr="10.0.0.2:31555")
        parsed.append(parser.parse_args(argv[argv.index("sglang.launch_server") + 1:]))
    assert [(a.tp_size, a.nnodes, a.node_rank, a.dist_init_addr, a.host) for a in parsed] == [
        (16, 2, 0, "10.0.0.2:31555", "10.0.0.2"), (16, 2, 1, "10.0.0.2:31555", "10.0.0.3")]
    assert parsed[0].random_seed == parsed[1].random_seed  # one engine: one seed
    with pytest.raises(ValueError, match="--dist-init-addr"):
        engine_command(cfg, slot, "10.0.0.2", 31000, None, use_gpu=True)


def test_a_ray_clusters_gpu_nodes_give_the_planned_shape():
    nodes = [{"Resources": {"CPU": 16.0}},  # a CPU-only head holds no GPU bundle
             {"Resources": {"CPU": 128.0, "GPU": 8.0}}, {"Resources": {"CPU": 128.0, "GPU": 8.0}}]
    assert gpu_shape(nodes) == (2, 8)
    assert gpu_shape([{"Resources": {"CPU": 2.0}}]) == (1, 0)
    assert gpu_shape([{"Resources": {"GPU": 8.0}}, {"Resources": {"GPU": 4.0}}]) == (2, 4)


def test_fault_tolerance_with_an_engine_over_nodes_is_refused_before_any_actor(tiny_qwen2, tmp_path):
    from slime_rl.config import ConfigError
    from slime_rl.train import preflight

    cfg = _cfg(tiny_qwen2, tmp_path, "--use-fault-tolerance", "--dry-run", "--cluster", "3x8")
    with pytest.raises(ConfigError, match="--use-fault-tolerance restarts a dead engine's one process; an engine "
                                          "over 2 nodes"):
        preflight(cfg)
