"""--use-rollout-routing-replay (slime's R3) and --use-routing-replay (slime's R2, implied by R3): parsed
into the trainer group, checked against the checkpoint and the layout in preflight (errors name the flag), and the
engines are started so that they return their routing (SGLang's --enable-return-routed-experts)."""

from __future__ import annotations

import pytest

from slime_rl.config import ConfigError
from slime_rl.config.builtin_engine import parse_server_args
from slime_rl.orchestration.engines import engine_command
from slime_rl.orchestration.placement import EngineSlot
from slime_rl.train import check_model_features
from tests.config.test_moe_flags import _cfg


def test_flags_reach_the_trainer_group_and_are_accepted_on_moe(tiny_qwen3_moe):
    cfg = _cfg(tiny_qwen3_moe, "--use-rollout-routing-replay", "--use-routing-replay")
    assert cfg.trainer.use_rollout_routing_replay and cfg.trainer.use_routing_replay
    check_model_features(cfg)
    r2 = _cfg(tiny_qwen3_moe, "--use-routing-replay")  # R2 alone: the old-log-prob pass's routing
    assert r2.trainer.use_routing_replay and not r2.trainer.use_rollout_routing_replay
    check_model_features(r2)
    check_model_features(_cfg(tiny_qwen3_moe, "--use-routing-replay", "--actor-num-gpus-per-node", "4",
                              "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                              "--sequence-parallel"))
    default = _cfg(tiny_qwen3_moe).trainer
    assert not default.use_rollout_routing_replay and not default.use_routing_replay


@pytest.mark.parametrize("extra,match", [
    (("--use-routing-replay", "--actor-num-gpus-per-node", "2", "--context-parallel-size", "2"),
     "--use-routing-replay with --context-parallel-size 2"),
    (("--use-routing-replay", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"), "--use-routing-replay with --recompute-granularity full"),
    (("--use-rollout-routing-replay", "--actor-num-gpus-per-node", "2", "--context-parallel-size", "2"),
     "--use-rollout-routing-replay with --context-parallel-size 2"),
    (("--use-rollout-routing-replay", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"), "--use-rollout-routing-replay with --recompute-granularity full"),
])
def test_refused_layouts(tiny_qwen3_moe, extra, match):
    with pytest.raises(ConfigError, match=match):
        check_model_features(_cfg(tiny_qwen3_moe, *extra))


@pytest.mark.parametrize("flag", ["--use-rollout-routing-replay", "--use-routing-replay"])
def test_refused_for_a_dense_model(tiny_qwen2, flag):
    with pytest.raises(ConfigError, match=f"{flag}: .* dense model \\('qwen2'\\)"):
        check_model_features(_cfg(tiny_qwen2, flag))


def test_engines_are_started_returning_their_routing(tiny_qwen3_moe):
    slot = EngineSlot(engine_id=0, bundles=(0,), rank_offset=1)
    for replay in (False, True):
        cfg = _cfg(tiny_qwen3_moe, *(["--use-rollout-routing-replay"] if replay else []))
        argv = engine_command(cfg, slot, "127.0.0.1", 9000, None, use_gpu=False)
        args = parse_server_args(argv[3:])
        assert args.enable_return_routed_experts is replay
        sg = _cfg(tiny_qwen3_moe, "--rollout-backend", "sglang", *(["--use-rollout-routing-replay"] if replay else []))
        argv = engine_command(sg, slot, "127.0.0.1", 9000, None, use_gpu=True)
        assert ("--enable-return-routed-experts" in argv) is replay
