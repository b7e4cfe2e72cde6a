"""PPO's critic flags (slime's names) and its placement: defaults, checks naming the flag, bundles."""

from __future__ import annotations

import pytest

from slime_rl.config import ConfigError, EngineConfig, ParallelConfig, build_config
from slime_rl.orchestration.placement import PlacementError, plan_placement
from tests.config.test_config import base_argv

PPO = ["--advantage-estimator", "ppo"]


def test_critic_defaults_follow_the_actor(tmp_path):
    cfg = build_config(base_argv(tmp_path) + PPO + ["--actor-num-gpus-per-node", "2", "--lr", "3e-4",
                                                    "--min-lr", "3e-5"])
    c = cfg.critic
    assert (c.num_nodes, c.num_gpus_per_node, c.lr, c.num_critic_only_steps) == (1, 2, 3e-4, 0)
    assert cfg.algo.use_critic and cfg.algo.token_level_advantages
    assert (cfg.algo.gamma, cfg.algo.lambd, cfg.algo.value_clip) == (1.0, 1.0, 0.2)  # slime's defaults
    opt = c.optimizer(cfg.optimizer)
    assert opt.lr == 3e-4 and opt.min_lr == pytest.approx(3e-5)


def test_critic_flags_set_its_group(tmp_path):
    cfg = build_config(base_argv(tmp_path) + PPO + [
        "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2", "--critic-num-gpus-per-node", "4",
        "--global-batch-size", "4", "--micro-batch-size", "2", "--critic-lr", "1e-5", "--min-lr", "1e-7",
        "--critic-lr-warmup-iters", "1", "--num-critic-only-steps", "2", "--gamma", "0.9", "--lambd", "0.95",
        "--value-clip", "0.5"])
    c = cfg.critic
    assert (c.world_size, c.lr, c.lr_warmup_iters, c.num_critic_only_steps) == (4, 1e-5, 1, 2)
    par = c.parallel(cfg.parallel)
    assert (par.world_size, par.tensor_model_parallel_size, par.data_parallel_size) == (4, 2, 2)
    opt = c.optimizer(cfg.optimizer)
    assert (opt.lr, opt.lr_warmup_iters) == (1e-5, 1) and opt.min_lr == pytest.approx(1e-7 * 1e-5 / 1e-6)
    assert (cfg.algo.gamma, cfg.algo.lambd, cfg.algo.value_clip) == (0.9, 0.95, 0.5)


def test_no_critic_without_ppo(tmp_path):
    assert build_config(base_argv(tmp_path)).critic is None


@pytest.mark.parametrize("extra, flag", [
    (["--critic-lr", "1e-5"], "--critic-lr"),  # not ppo
    (["--num-critic-only-steps", "1"], "--num-critic-only-steps"),
    (PPO + ["--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2", "--critic-num-gpus-per-node", "3"],
     "--critic-num-gpus-per-node"),
    (PPO + ["--critic-num-gpus-per-node", "3"], "critic's data-parallel size"),  # 8 samples, dp 3
    (PPO + ["--value-clip", "0"], "--value-clip"),
    (PPO + ["--lambd", "1.5"], "--lambd"),
    (PPO + ["--critic-lr", "0"], "--critic-lr"),
    (PPO + ["--critic-save", "/tmp/x"], "--critic-save needs --save"),
])
def test_bad_critic_flags_name_the_flag(tmp_path, extra, flag):
    with pytest.raises(ConfigError, match=flag):
        build_config(base_argv(tmp_path) + extra)


def test_placement_puts_the_critic_between_trainer_and_engines():
    plan = plan_placement(ParallelConfig(actor_num_gpus_per_node=2), EngineConfig(num_gpus=2), cluster_gpus=8,
                          critic_world=3)
    assert plan.trainer_bundles == (0, 1) and plan.critic_bundles == (2, 3, 4)
    assert [e.bundles for e in plan.engines] == [(5,), (6,)]
    assert len(plan.bundles) == 7 and plan.weight_update_world_size == 3  # the critic sends no weights
    assert "critic ranks 0..2 -> bundles [2, 3, 4]" in plan.describe()
    with pytest.raises(PlacementError, match="--critic-num-nodes x --critic-num-gpus-per-node = 3"):
        plan_placement(ParallelConfig(actor_num_gpus_per_node=2), EngineConfig(num_gpus=2), cluster_gpus=6,
                       critic_world=3)
