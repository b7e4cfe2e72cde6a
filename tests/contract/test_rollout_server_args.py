"""The engine launch command of a run, parsed by SGLang 0.5.23's own `ServerArgs` CLI parser: a
multi-GPU engine (--rollout-num-gpus-per-engine N: --tp-size N on the N GPUs its actor holds,
starting at base GPU 0 of what Ray makes visible) and --deterministic-rollout (SGLang honours a
request's sampling_seed only with --enable-deterministic-inference)."""

from __future__ import annotations

import argparse

import pytest

from slime_rl.config import build_config
from slime_rl.config.builtin_engine import parse_server_args
from slime_rl.orchestration.engines import engine_command
from slime_rl.orchestration.placement import plan_placement

server_args = pytest.importorskip("sglang.srt.server_args",
                                  reason="sglang 0.5.23 is not importable here (pip install --no-deps sglang)")


def _cfg(model, tmp_path, *extra):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "1", "label": "1"}\n')
    return build_config(["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rollout-batch-size", "1",
                         "--num-rollout", "1", "--rm-type", "digit", *extra])


def _sglang_parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False)
    server_args.ServerArgs.add_cli_args(p)
    i = argv.index("sglang.launch_server")
    return p.parse_args(argv[i + 1:])


def test_two_gpu_engines_launch_with_tp_2_on_the_gpus_their_actor_holds(tiny_qwen2, tmp_path):
    cfg = _cfg(tiny_qwen2, tmp_path, "--rollout-backend", "sglang", "--rollout-num-gpus", "4",
               "--rollout-num-gpus-per-engine", "2", "--actor-num-gpus-per-node", "2",
               "--tensor-model-parallel-size", "2")
    plan = plan_placement(cfg.parallel, cfg.engine, cluster_gpus=6)
    assert len(plan.engines) == 2
    for slot in plan.engines:
        ns = _sglang_parse(engine_command(cfg, slot, "10.0.0.3", 30000 + slot.engine_id, None, use_gpu=True))
        # SGLang uses GPUs base_gpu_id .. base_gpu_id + tp_size - 1 of those visible: exactly the actor's
        assert (ns.tp_size, ns.base_gpu_id) == (2, 0)
        assert plan.engine_actor_gpu(slot) == 2.0 and plan.bundles[slot.bundles[0]]["GPU"] == 2.0
        assert ns.enable_deterministic_inference is False
    # NCCL weight-update group: trainer rank 0, then 2 ranks per engine
    assert [s.rank_offset for s in plan.engines] == [1, 3] and plan.weight_update_world_size == 5


def test_deterministic_rollout_launches_sglang_with_deterministic_inference(tiny_qwen2, tmp_path):
    cfg = _cfg(tiny_qwen2, tmp_path, "--rollout-backend", "sglang", "--deterministic-rollout")
    plan = plan_placement(cfg.parallel, cfg.engine, cluster_gpus=2)
    ns = _sglang_parse(engine_command(cfg, plan.engines[0], "h", 30000, None, use_gpu=True))
    assert ns.enable_deterministic_inference is True and (ns.tp_size, ns.base_gpu_id) == (1, 0)


def test_deterministic_rollout_switches_the_built_in_engine_the_same_way(tiny_qwen2, tmp_path):
    for extra, want in (((), False), (("--deterministic-rollout",), True)):
        cfg = _cfg(tiny_qwen2, tmp_path, *extra)
        plan = plan_placement(cfg.parallel, cfg.engine, cluster_gpus=0)
        argv = engine_command(cfg, plan.engines[0], "127.0.0.1", 30000, None, use_gpu=False)
        ns = parse_server_args(argv[argv.index("slime_rl.engines.embedded") + 1:])
        assert ns.enable_deterministic_inference is want
        # the built-in engine's flag is SGLang's: the same switch parses in SGLang's parser
        p = argparse.ArgumentParser(add_help=False)
        server_args.ServerArgs.add_cli_args(p)
        assert p.parse_args(["--model-path", "/m", "--enable-deterministic-inference"]).enable_deterministic_inference
