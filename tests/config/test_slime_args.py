"""slime's `args` for slime-style extension functions (slime's attribute names, the run's values),
and slime's extension flags we have no counterpart for, refused by name with the reason."""

from __future__ import annotations

import pytest

from slime_rl.config import ConfigError, build_config
from slime_rl.config.slime_args import SLIME_ONLY_FLAGS, slime_args

BASE = ["--hf-checkpoint", "m", "--prompt-data", "d.jsonl", "--rollout-batch-size", "4", "--num-rollout", "2",
        "--rm-type", "digit"]


def test_args_carry_slime_names_and_the_runs_values():
    cfg = build_config(BASE + ["--n-samples-per-prompt", "8", "--rollout-max-response-len", "64",
                               "--rollout-temperature", "0.7", "--custom-rm-path", "x.py:rm", "--reward-key", "acc",
                               "--disable-grpo-std-normalization", "--eval-prompt-data", "a", "a.jsonl",
                               "--eval-interval", "1", "--rollout-stop", "</s>", "--sglang-server-concurrency", "3"],
                       check_paths=False)
    args = slime_args(cfg)
    # slime's attribute names (slime/utils/arguments.py) with the values given above
    assert (args.n_samples_per_prompt, args.rollout_max_response_len, args.rollout_temperature) == (8, 64, 0.7)
    assert (args.rollout_batch_size, args.hf_checkpoint, args.custom_rm_path) == (4, "m", "x.py:rm")
    assert args.reward_key == "acc" and args.rm_type == "digit" and args.sglang_server_concurrency == 3
    assert args.rollout_stop == ["</s>"] and args.rollout_stop_token_ids is None
    assert args.disable_grpo_std_normalization is True and args.deterministic_rollout is False
    assert args.eval_prompt_data == ["a", "a.jsonl"] and args.num_rollout == 2
    assert args.global_batch_size == 4 * 8  # derived: one optimizer step per rollout
    assert args.rollout_num_gpus == 1 and args.rollout_top_k == -1 and args.partial_rollout is False
    # what slime's own generate reads besides the flags
    assert args.sglang_router_ip is None and args.rollout_global_dataset is True and args.ci_test is False
    assert slime_args(cfg, sglang_router_port=5).sglang_router_port == 5


def test_model_args_under_megatrons_names():
    """slime's MODEL_ARGS reach `args` as Megatron-LM's parser names them (args.num_layers, args.swiglu, ...);
    a flag not given is None (a switch False)."""
    cfg = build_config(BASE + ["--num-layers", "36", "--swiglu", "--moe-layer-freq", "[1]*2"], check_paths=False)
    args = slime_args(cfg)
    assert (args.num_layers, args.swiglu, args.moe_layer_freq) == (36, True, [1, 1])
    assert args.hidden_size is None and args.qk_layernorm is False


def test_sglang_passthrough_and_deterministic_rollout():
    cfg = build_config(BASE + ["--rollout-backend", "sglang", "--sglang-mem-fraction-static", "0.5",
                               "--deterministic-rollout"], check_paths=False)
    args = slime_args(cfg)
    assert args.sglang_mem_fraction_static == "0.5" and args.deterministic_rollout is True
    assert args.sglang_enable_deterministic_inference is True


@pytest.mark.parametrize("flag", ["--eval-function-path", "--buffer-filter-path", "--custom-loss-function-path",
                                  "--rollout-sample-filter-path", "--data-source-path"])
def test_slime_only_flags_are_refused_by_name(flag):
    with pytest.raises(ConfigError, match=f"^{flag} is slime's and has no counterpart here: "):
        build_config(BASE + [flag, "my.module.fn"], check_paths=False)
    with pytest.raises(ConfigError, match=f"^{flag} is slime's"):
        build_config(BASE + [f"{flag}=my.module.fn"], check_paths=False)


def test_slime_only_flag_in_a_yaml_config(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout-batch-size: 4\ncustom_loss_function_path: a.b\n")
    with pytest.raises(ConfigError, match=f"--config {path}: --custom-loss-function-path is slime's.*--advantage"):
        build_config(BASE + ["--config", str(path)], check_paths=False)


def test_every_refused_flag_is_a_slime_extension_flag_we_do_not_parse():
    from slime_rl.config.flags import FLAGS

    ours = {f.name for f in FLAGS}
    assert not ours & set(SLIME_ONLY_FLAGS)
    assert all(reason for reason in SLIME_ONLY_FLAGS.values())
