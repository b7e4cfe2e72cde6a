import os
import shlex
import subprocess

import pytest

from slime_rl.config import ConfigError, build_config, parse_flags
from slime_rl.config.builtin_engine import API_KEY_ENV, parse_server_args
from slime_rl.train import main as train_main


def base_argv(tmp_path):
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "data.jsonl").write_text('{"input": "x", "label": "1"}\n')
    return ["--hf-checkpoint", str(tmp_path / "model"), "--prompt-data", str(tmp_path / "data.jsonl"),
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "3", "--rm-type", "digit"]


def test_groups_from_megatron_names(tmp_path):
    cfg = build_config(base_argv(tmp_path) + ["--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "4",
                                              "--lr", "3e-4", "--global-batch-size", "4", "--micro-batch-size", "2"])
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.parallel.data_parallel_size == 2
    assert cfg.optimizer.lr == 3e-4
    assert cfg.batch.global_batch_size == 4
    assert cfg.algo.eps_clip_high == cfg.algo.eps_clip  # defaults to --eps-clip


def test_global_batch_defaults_to_one_step_per_rollout(tmp_path):
    cfg = build_config(base_argv(tmp_path))
    assert cfg.batch.global_batch_size == 4 * 2


@pytest.mark.parametrize("extra, flag", [
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size"),
    (["--tensor-model-parallel-size", "3", "--actor-num-gpus-per-node", "4"], "--tensor-model-parallel-size"),
    (["--global-batch-size", "3"], "--global-batch-size"),
    (["--eps-clip", "1.5"], "--eps-clip"),
    (["--lr-decay-style", "bogus"], "--lr-decay-style"),
    (["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"], "--rollout-num-gpus-per-engine"),
    (["--lr", "-1"], "--lr"),
    (["--rollout-backend", "embedded", "--sglang-mem-fraction-static", "0.8"], "--sglang-"),
    (["--sglang-cuda-graph-max-bs-decode", "0"], "--sglang-cuda-graph-max-bs-decode"),
    (["--no-such-flag", "1"], "--no-such-flag"),
    (["--keep-last", "2"], "--keep-last"),
    (["--group-rm"], "--group-rm"),
    (["--ref-update-interval", "5"], "--ref-update-interval"),
    (["--use-fault-tolerance", "--use-sglang-router"], "--use-fault-tolerance"),
])
def test_bad_flag_values_name_the_flag(tmp_path, extra, flag):
    with pytest.raises(ConfigError) as err:
        build_config(base_argv(tmp_path) + extra)
    assert flag in str(err.value)


def test_missing_files_name_the_flag(tmp_path):
    argv = base_argv(tmp_path)
    argv[argv.index("--prompt-data") + 1] = str(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match="--prompt-data"):
        build_config(argv)


def test_yaml_overlay_and_cli_precedence(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("lr: 0.01\nmicro-batch-size: 2\nsglang_mem_fraction_static: 0.7\nrollout-backend: sglang\n")
    cfg = build_config(base_argv(tmp_path) + ["--config", str(cfg_file), "--lr", "0.02"])
    assert cfg.optimizer.lr == 0.02  # command line beats the file
    assert cfg.batch.micro_batch_size == 2  # the file beats the default
    assert cfg.engine.sglang_args == {"mem_fraction_static": 0.7}


def test_yaml_key_given_twice_is_an_error_naming_it_and_both_lines(tmp_path):
    """PyYAML keeps the last of two equal keys silently; YAML says keys are unique."""
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("lr: 0.01\nmicro-batch-size: 2\nlr: 0.02\n")
    with pytest.raises(ConfigError, match=r"c.yaml: not valid YAML: key 'lr' is given twice \(lines 1 and 3\)"):
        build_config(base_argv(tmp_path) + ["--config", str(cfg_file)])
    cfg_file.write_text("worker:\n  actor:\n    lr: 1\n  rollout:\n    lr: 2\n")  # same key, other mappings: fine
    with pytest.raises(ConfigError) as err:
        build_config(base_argv(tmp_path) + ["--config", str(cfg_file)])
    assert "is given twice" not in str(err.value)


def test_yaml_unknown_key_names_file_and_key(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("learning-rate: 0.01\n")
    with pytest.raises(ConfigError, match="learning-rate"):
        build_config(base_argv(tmp_path) + ["--config", str(cfg_file)])


@pytest.mark.parametrize("line, packed", [("no-pack-sequences: true", False), ("no-pack-sequences: false", True),
                                           ("pack-sequences: false", False), ("", True)])
def test_yaml_switch_by_its_flag_name_says_what_the_flag_says(tmp_path, line, packed):
    # `no-pack-sequences` is the flag a user types (store_false, dest pack_sequences); it was refused
    # as "not a flag of slime-rl train"
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(line + "\n")
    assert build_config(base_argv(tmp_path) + ["--config", str(cfg_file)]).trainer.pack_sequences is packed
    on_cli = build_config(base_argv(tmp_path) + ["--no-pack-sequences"]).trainer.pack_sequences
    assert on_cli is False


def test_yaml_switch_by_its_flag_name_wants_a_bool(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("no-pack-sequences: 1\n")
    with pytest.raises(ConfigError, match="no-pack-sequences.*true or false"):
        build_config(base_argv(tmp_path) + ["--config", str(cfg_file)])


def test_sglang_passthrough_names(tmp_path):
    args, sglang = parse_flags(["--sglang-mem-fraction-static", "0.8", "--sglang-enable-torch-compile",
                                "--sglang-chunked-prefill-size=4096", "--sglang-server-concurrency", "8"])
    assert args.sglang_server_concurrency == 8  # ours (slime's name), not passed through
    assert sglang == {"mem_fraction_static": "0.8", "enable_torch_compile": True, "chunked_prefill_size": "4096"}


def test_cli_prints_error_naming_flag(tmp_path, capsys):
    code = train_main(base_argv(tmp_path) + ["--micro-batch-size", "abc"])
    assert code == 2
    assert "--micro-batch-size" in capsys.readouterr().err


def test_dry_run_prints_plan_and_engine_commands(tiny_qwen2, tmp_path, capsys):
    from slime_rl.data.digits import make_rows, write_jsonl

    data = write_jsonl(make_rows(8, seed=0), tmp_path / "d.jsonl")
    code = train_main(["--hf-checkpoint", str(tiny_qwen2), "--prompt-data", str(data), "--rollout-batch-size", "2",
                       "--num-rollout", "1", "--rm-type", "digit", "--tensor-model-parallel-size", "2",
                       "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    assert "trainer ranks 0..1 -> bundles [0, 1]" in out
    assert "engine 1 -> bundles [3], weight-update rank_offset 2" in out
    engine_lines = [ln for ln in out.splitlines() if ln.startswith("engine 0:") or ln.startswith("engine 1:")]
    assert len(engine_lines) == 2
    for ln in engine_lines:  # bash expands the printed line as pasted; the engine's own parser reads it back
        expanded = subprocess.run(["bash", "-c", f'for w in {ln.split(": ", 1)[1]}; do printf "%s\\0" "$w"; done'],
                                  env={"ENGINE_HOST": "10.0.0.7", "SLIME_RL_API_KEY": "s3cret", "PATH": os.defpath},
                                  capture_output=True, text=True, check=True).stdout.split("\0")[:-1]
        args = parse_server_args(expanded[expanded.index("-m") + 2:])
        assert args.model_path == str(tiny_qwen2) and args.host == "10.0.0.7"
        assert f"{API_KEY_ENV}=s3cret" in expanded  # the built-in engine takes its key from the environment
    assert '"${SLIME_RL_API_KEY}"' in engine_lines[0]  # the real per-run secret is never printed


def test_num_epoch_sets_steps_once_the_data_is_read(tiny_qwen2, tmp_path):
    from slime_rl.data.digits import make_rows, write_jsonl
    from slime_rl.train import preflight

    data = write_jsonl(make_rows(10, seed=0), tmp_path / "d.jsonl")
    base = ["--hf-checkpoint", str(tiny_qwen2), "--prompt-data", str(data), "--rollout-batch-size", "4",
            "--rm-type", "digit"]
    cfg, _ = preflight(build_config(base + ["--num-epoch", "3"]))
    assert cfg.rollout.num_rollout == 3 * 10 // 4  # 30 prompt draws in batches of 4
    with pytest.raises(ConfigError, match="--num-rollout and --num-epoch"):
        build_config(base + ["--num-epoch", "3", "--num-rollout", "2"])
    sliced, _ = preflight(build_config(base + ["--num-epoch", "1"] + ["--prompt-data", f"{data}@[0:8]"]))
    assert sliced.rollout.num_rollout == 2  # the slice keeps 8 rows


def test_reward_flags_reach_the_reward_function(tmp_path):
    from slime_rl.rewards import RewardError
    from slime_rl.train import reward_fn

    cfg = build_config(base_argv(tmp_path) + ["--rm-type", "remote_rm"])
    with pytest.raises(RewardError, match="--rm-url"):
        reward_fn(cfg.reward)  # remote_rm without a URL is refused before any actor starts
    ok = build_config(base_argv(tmp_path) + ["--rm-type", "math"])
    assert callable(reward_fn(ok.reward))
    from slime_rl.rewards import GroupReward

    group = build_config(base_argv(tmp_path) + ["--group-rm", "--custom-rm-path",
                                                "tests.rewards.plugins.easyr1_reward:compute_score_batch"])
    assert isinstance(reward_fn(group.reward), GroupReward)


def test_dry_run_sglang_backend_passes_sglang_flags_through(tiny_qwen2, tmp_path, capsys):
    from slime_rl.data.digits import make_rows, write_jsonl

    data = write_jsonl(make_rows(8, seed=0), tmp_path / "d.jsonl")
    code = train_main(["--hf-checkpoint", str(tiny_qwen2), "--prompt-data", str(data), "--rollout-batch-size", "2",
                       "--num-rollout", "1", "--rm-type", "digit", "--rollout-backend", "sglang",
                       "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2",
                       "--sglang-mem-fraction-static", "0.7", "--sglang-enable-torch-compile", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    (line,) = [ln for ln in out.splitlines() if ln.startswith("engine 0:")]
    argv_ = shlex.split(line)[2:]
    assert argv_[1:3] == ["-m", "sglang.launch_server"]
    assert argv_[argv_.index("--tp-size") + 1] == "2"
    assert argv_[argv_.index("--mem-fraction-static") + 1] == "0.7" and "--enable-torch-compile" in argv_


def test_dry_run_embedded_backend_takes_its_cuda_graph_flags(tiny_qwen2, tmp_path, capsys):
    from slime_rl.data.digits import make_rows, write_jsonl

    data = write_jsonl(make_rows(8, seed=0), tmp_path / "d.jsonl")
    code = train_main(["--hf-checkpoint", str(tiny_qwen2), "--prompt-data", str(data), "--rollout-batch-size", "2",
                       "--num-rollout", "1", "--rm-type", "digit", "--sglang-disable-cuda-graph",
                       "--sglang-cuda-graph-max-bs-decode", "16", "--sglang-disable-overlap-schedule",
                       "--sglang-enable-torch-compile", "--sglang-torch-compile-max-bs", "8", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    (line,) = [ln for ln in out.splitlines() if ln.startswith("engine 0:")]
    argv_ = shlex.split(line)[2:]
    assert argv_[argv_.index("-m") + 1] == "slime_rl.engines.embedded"
    engine = parse_server_args(argv_[argv_.index("-m") + 2:])  # the engine's own parser reads the printed line
    assert engine.disable_cuda_graph and engine.cuda_graph_max_bs == 16 and engine.disable_overlap_schedule
    assert engine.enable_torch_compile and engine.torch_compile_max_bs == 8


@pytest.mark.parametrize("value", ["0", "x"])
def test_embedded_torch_compile_max_bs_must_be_a_positive_integer(tmp_path, value):
    with pytest.raises(ConfigError, match="--sglang-torch-compile-max-bs ('x': expected int|0: must be >= 1)"):
        build_config(base_argv(tmp_path) + ["--rollout-backend", "embedded", "--sglang-torch-compile-max-bs", value])


@pytest.mark.parametrize("extra, flag", [
    (["--rollout-top-k", "0"], "--rollout-top-k"),
    (["--rollout-top-k", "-2"], "--rollout-top-k"),
    (["--rollout-top-k", str(10**20)], "--rollout-top-k"),
    (["--rollout-temperature", "nan"], "--rollout-temperature"),
    (["--rollout-temperature", "inf"], "--rollout-temperature"),
    (["--rollout-top-p", "nan"], "--rollout-top-p"),
])
def test_sampling_flags_out_of_sglang_range(tmp_path, extra, flag):
    # SGLang 0.5.23 SamplingParams.verify: top_k is -1 or >= 1 (-1 becomes 1 << 30); a NaN or infinite
    # temperature has no distribution to sample from
    with pytest.raises(ConfigError, match=flag):
        build_config(base_argv(tmp_path) + extra)


def test_sampling_flags_at_the_edges_pass(tmp_path):
    cfg = build_config(base_argv(tmp_path) + ["--rollout-top-k", str(1 << 30), "--rollout-temperature", "1e-3"])
    assert cfg.rollout.top_k == 1 << 30


def test_load_of_a_missing_folder_is_an_error(tmp_path):
    missing = tmp_path / "chekpoints"  # a typo of a folder that exists
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(ConfigError, match=f"--load {missing}: no such folder"):
        build_config(base_argv(tmp_path) + ["--load", str(missing)])
    # the same path in --save is auto-resume: the folder appears with the first save
    cfg = build_config(base_argv(tmp_path) + ["--load", str(missing), "--save", str(missing)])
    assert cfg.checkpoint.load == str(missing)
    build_config(base_argv(tmp_path) + ["--load", str(tmp_path / "checkpoints")])


def test_prompt_longer_than_the_model_context_fails_in_preflight(tiny_qwen2, tmp_path, capsys):
    import json
    import shutil

    model = shutil.copytree(tiny_qwen2, tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": 40}))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"input": "1", "label": "1"}) + "\n" + json.dumps({"input": "1 " * 60, "label": "1"})
                    + "\n")
    argv = ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rollout-batch-size", "1",
            "--num-rollout", "1", "--rm-type", "digit", "--rollout-max-response-len", "8", "--dry-run"]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert "line 2: the prompt has" in err and "context of 40 (max_position_embeddings of" in err
    assert "--rollout-max-prompt-len 32" in err  # 40 - 8 for the response
    assert train_main(argv + ["--rollout-max-prompt-len", "32"]) == 0
    # a response budget the context cannot hold is the flag's error, not every row's
    code = train_main([a if a != "8" else "40" for a in argv])
    assert code == 2 and "--rollout-max-response-len 40: no prompt fits" in capsys.readouterr().err
    # unless --rollout-max-context-len caps each response to what the prompt leaves: then only the long
    # row is wrong (line 1 has room left), and dropping it lets the run start
    capped = [a if a != "8" else "40" for a in argv] + ["--rollout-max-context-len", "40"]
    assert train_main(capped) == 2
    err = capsys.readouterr().err
    assert "1 bad row(s) of 2" in err and "line 2: the prompt has" in err and "no prompt fits" not in err
    assert train_main(capped + ["--rollout-max-prompt-len", "39"]) == 0


def test_multi_gpu_engines_need_sglang(tmp_path):
    # the weight-update group counts N ranks per engine; the built-in engine is one process on one device
    gpus = ["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2"]
    with pytest.raises(ConfigError, match="--rollout-num-gpus-per-engine 2 needs --rollout-backend sglang"):
        build_config(base_argv(tmp_path) + gpus + ["--rollout-backend", "embedded"])
    with pytest.warns(UserWarning, match="--rollout-backend sglang: --rollout-num-gpus-per-engine 2"):
        assert build_config(base_argv(tmp_path) + gpus).engine.backend == "sglang"  # none given: SGLang's
    assert build_config(base_argv(tmp_path) + gpus + ["--rollout-backend", "sglang"]).engine.num_engines == 2


def test_fp32_lm_head_is_one_switch_for_engines_and_trainer(tmp_path):
    from slime_rl.orchestration.engines import engine_command
    from slime_rl.orchestration.placement import plan_placement

    cfg = build_config(base_argv(tmp_path))
    assert cfg.model.fp32_lm_head is False  # SGLang's default: bf16 logits
    for flag in (["--sglang-enable-fp32-lm-head"], ["--sglang-enable-fp32-lm-head", "true"]):
        cfg = build_config(base_argv(tmp_path) + flag)
        assert cfg.model.fp32_lm_head is True  # the trainer's output layer follows the engines' flag
        plan = plan_placement(cfg.parallel, cfg.engine, cluster_gpus=0, cluster_cpus=2)
        argv = engine_command(cfg, plan.engines[0], host="h", port=1, api_key=None, use_gpu=False)
        assert parse_server_args(argv[3:]).enable_fp32_lm_head  # the built-in engine gets it
    assert build_config(base_argv(tmp_path) + ["--sglang-enable-fp32-lm-head", "false"]).model.fp32_lm_head is False


def test_gspo_with_token_mean_warns_and_keeps_the_default(tmp_path):
    """GSPO's paper (and verl) average per sequence first; the default stays token-mean (no recipe's
    numbers move) and the run is warned."""
    import warnings

    gspo = base_argv(tmp_path) + ["--advantage-estimator", "gspo"]
    with pytest.warns(UserWarning, match="--loss-agg-mode seq-mean-token-mean"):
        cfg = build_config(gspo)
    assert cfg.trainer.loss_agg_mode == "token-mean"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_config(gspo + ["--loss-agg-mode", "seq-mean-token-mean"])
        build_config(base_argv(tmp_path))  # grpo: token-mean is DAPO's choice, no warning


def test_derived_sizes(tmp_path):
    cfg = build_config(base_argv(tmp_path) + ["--global-batch-size", "4"])
    assert cfg.rollout.samples_per_rollout == 4 * 2
    assert cfg.optimizer_steps_per_rollout == 2
    assert cfg.rollout.draw_size == 4
    assert build_config(base_argv(tmp_path) + ["--over-sampling-batch-size", "6"]).rollout.draw_size == 6


def test_every_critic_flag_needs_a_critic(tmp_path):
    for extra in (["--critic-lr-warmup-iters", "2"], ["--critic-num-nodes", "1"], ["--num-critic-only-steps", "1"]):
        with pytest.raises(ConfigError, match=f"{extra[0]}: critic flags need --advantage-estimator ppo"):
            build_config(base_argv(tmp_path) + extra)
