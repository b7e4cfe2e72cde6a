"""--config with EasyR1's nested layout: EasyR1's example config for Qwen2.5-VL geo3k
(tests/config/easyr1/geo3k_config.yaml, model path and data replaced by local ones) mapped key by key,
the mapping printed, keys that cannot be honoured refused by name, and --dry-run on it with a tiny
Qwen2.5-VL and local rows. Expected values are EasyR1's own semantics, worked out by hand: its
global_batch_size counts prompts (x rollout.n), its actor defaults clip_ratio_high 0.3 and
clip_ratio_dual 3.0 (verl/workers/actor/config.py), lr_warmup_steps count rollout steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from slime_rl.config import ConfigError, build_config
from slime_rl.config.easyr1 import flatten
from slime_rl.rollout.custom import load_filter

HERE = Path(__file__).parent / "easyr1"
FIXTURE = HERE / "geo3k_config.yaml"
REWARD = f"{HERE / 'math_reward.py'}:compute_score"


def write_config(tmp_path: Path, model: str = "/models/qwen2_5_vl", train: str = "/data/train.jsonl",
                 val: str = "/data/val.jsonl", edit: dict | None = None) -> Path:
    """The fixture with its placeholders replaced; `edit`: {"a.b.c": value} changes (None deletes)."""
    text = FIXTURE.read_text()
    for key, value in {"@MODEL@": model, "@TRAIN@": train, "@VAL@": val, "@PROMPT@": str(HERE / "math.jinja"),
                       "@REWARD@": REWARD, "@SAVE@": str(tmp_path / "ckpt")}.items():
        text = text.replace(key, value)
    data = yaml.safe_load(text)
    for dotted, value in (edit or {}).items():
        *parents, leaf = dotted.split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    out = tmp_path / "easyr1.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


def test_every_key_of_the_example_is_mapped_or_listed(tmp_path, capsys):
    build_config(["--config", str(write_config(tmp_path))], check_paths=False)
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert "EasyR1 config, mapped to flags" in lines[0]
    keys = flatten(yaml.safe_load(FIXTURE.read_text()))
    # every key of the file has a line: "key -> --flag value" or "key: not applicable (reason)"
    for key in keys:
        if key.startswith("worker.rollout.val_override_config"):
            continue  # one line per entry, below
        head = "trainer.logger" if key == "trainer.logger" else key
        assert any(line.strip().startswith((f"{head} ->", f"{head}:", f"{head} ")) for line in lines), key
    for sub in ("temperature", "top_p", "n"):
        assert f"worker.rollout.val_override_config.{sub} ->" in printed
    for key in ("worker.actor.fsdp.enable_full_shard", "worker.actor.offload.offload_params",
                "worker.actor.ulysses_size", "worker.rollout.enforce_eager", "worker.ref.fsdp.enable_cpu_offload"):
        assert any(line.strip().startswith(f"{key}: not applicable (") for line in lines), key


def test_values_follow_easyr1_semantics(tmp_path):
    cfg = build_config(["--config", str(write_config(tmp_path))], check_paths=False)
    assert cfg.model.hf_checkpoint == "/models/qwen2_5_vl" and cfg.data.prompt_data == "/data/train.jsonl"
    assert cfg.eval.datasets == (("val", "/data/val.jsonl"),) and cfg.eval.interval == 5
    assert (cfg.data.input_key, cfg.data.label_key, cfg.data.image_key) == ("problem", "answer", "images")
    assert cfg.data.apply_chat_template and cfg.data.rollout_max_prompt_len == 2048
    assert (cfg.data.min_pixels, cfg.data.max_pixels) == (262144, 4194304)
    assert cfg.rollout.rollout_batch_size == 512 and cfg.rollout.n_samples_per_prompt == 5
    assert cfg.rollout.max_response_len == 2048 and cfg.rollout.seed == 1 and cfg.data.rollout_shuffle
    assert cfg.batch.global_batch_size == 128 * 5  # EasyR1 counts prompts
    assert cfg.batch.micro_batch_size == 1 and cfg.optimizer.clip_grad == 1.0
    assert (cfg.algo.eps_clip, cfg.algo.eps_clip_high, cfg.algo.eps_clip_c) == (0.2, 0.3, 3.0)  # EasyR1's defaults
    assert cfg.algo.use_kl_loss and cfg.algo.kl_loss_coef == 0.01 and cfg.algo.kl_loss_type == "low_var_kl"
    assert cfg.algo.kl_coef == 0.0 and cfg.algo.advantage_estimator == "grpo"
    assert cfg.trainer.loss_agg_mode == "token-mean"
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay) == (1e-6, 0.01)
    assert (cfg.optimizer.adam_beta1, cfg.optimizer.adam_beta2) == (0.9, 0.999)
    assert cfg.engine.backend == "sglang" and cfg.engine.num_gpus_per_engine == 2
    assert cfg.engine.sglang_args["mem_fraction_static"] == 0.6
    assert cfg.parallel.actor_num_gpus_per_node == 8 and cfg.engine.num_gpus == 8
    assert (cfg.eval.temperature, cfg.eval.top_p, cfg.eval.n_samples_per_prompt) == (0.6, 0.95, 1)
    assert cfg.checkpoint.save == str(tmp_path / "ckpt") == cfg.checkpoint.load  # find_last_checkpoint
    assert (cfg.checkpoint.save_interval, cfg.checkpoint.keep_last) == (5, 3)
    assert cfg.reward.custom_rm_path == REWARD and cfg.data.num_epoch == 15
    assert cfg.logging.use_wandb and cfg.logging.wandb_project == "easy_r1"
    assert cfg.logging.wandb_group == "qwen2_5_vl_7b_geo_grpo"
    assert cfg.eval.log_generations == 3 and not cfg.logging.dump_rollouts  # val_generations_to_log: 3


def test_command_line_wins(tmp_path):
    cfg = build_config(["--config", str(write_config(tmp_path)), "--rollout-batch-size", "8",
                        "--global-batch-size", "40", "--rollout-backend", "embedded",
                        "--rollout-num-gpus-per-engine", "1"], check_paths=False)
    assert cfg.rollout.rollout_batch_size == 8 and cfg.engine.backend == "embedded"
    # with the built-in engine on the command line, gpu_memory_utilization has nothing to map to
    assert "mem_fraction_static" not in cfg.engine.sglang_args


@pytest.mark.parametrize("edit, named", [
    ({"worker.actor.model.lora.rank": 8, "worker.actor.model.lora.exclude_modules": ["q_proj"]},
     "worker.actor.model.lora.exclude_modules"),
    ({"algorithm.kl_type": "adaptive"}, "algorithm.kl_type"),
    ({"algorithm.adv_estimator": "remax"}, "algorithm.adv_estimator"),
    ({"worker.actor.loss_type": "vespo"}, "worker.actor.loss_type"),
    ({"worker.actor.loss_type": "cispo", "algorithm.adv_estimator": "rloo"}, "worker.actor.loss_type"),
    ({"worker.actor.ppo_epochs": 2}, "worker.actor.ppo_epochs"),
    ({"data.image_dir": "/images"}, "data.image_dir"),
    ({"data.override_chat_template": "t.jinja"}, "data.override_chat_template"),
    ({"worker.rollout.ignore_eos": True}, "worker.rollout.ignore_eos"),
    ({"worker.actor.model.override_config": {"rope_theta": 1.0}}, "worker.actor.model.override_config"),
    ({"worker.reward.skip_special_tokens": False}, "worker.reward.skip_special_tokens"),
    ({"trainer.val_only": True}, "trainer.val_only"),
    ({"worker.rollout.val_override_config": {"repetition_penalty": 1.1}},
     "worker.rollout.val_override_config.repetition_penalty"),
    ({"algorithm.use_kl_loss": False}, "algorithm.use_kl_loss"),  # KL in the rewards: not with grpo here
    ({"worker.actor.frobnicate": 1}, "worker.actor.frobnicate"),
])
def test_keys_that_cannot_be_honoured_are_errors_naming_them(tmp_path, edit, named):
    with pytest.raises(ConfigError, match=f"--config .*{named.replace('.', '[.]')}"):
        build_config(["--config", str(write_config(tmp_path, edit=edit))], check_paths=False)


def test_hub_dataset_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="data.train_files.*Hub dataset"):
        build_config(["--config", str(write_config(tmp_path, train="hiyouga/geometry3k@train"))], check_paths=False)


def test_counterparts_of_the_other_keys(tmp_path):
    edit = {"worker.actor.optim.lr_warmup_steps": 3, "worker.actor.optim.min_lr_ratio": 0.1,
            "worker.actor.optim.lr_scheduler_type": "cosine", "worker.actor.loss_avg_mode": "seq",
            "worker.actor.padding_free": False, "worker.rollout.max_model_len": 4096,
            "data.mini_rollout_batch_size": 64, "trainer.max_steps": 7, "trainer.val_before_train": False,
            "trainer.logger": ["console", "tensorboard"],
            "worker.reward.reward_function_kwargs": {"format_weight": 0.5},
            "algorithm.kl_penalty": "kl"}
    cfg = build_config(["--config", str(write_config(tmp_path, edit=edit))], check_paths=False)
    # 3 rollout steps x (512 prompts / 128 prompts per optimizer step) optimizer steps each
    assert cfg.optimizer.lr_warmup_iters == 12 and cfg.optimizer.lr_warmup_fraction is None
    assert cfg.optimizer.min_lr == pytest.approx(1e-7) and cfg.optimizer.lr_decay_style == "cosine"
    assert cfg.trainer.loss_agg_mode == "seq-mean-token-mean" and not cfg.trainer.pack_sequences
    assert cfg.rollout.rollout_max_context_len == 4096 and cfg.rollout.over_sampling_batch_size == 64
    assert cfg.rollout.num_rollout == 7 and cfg.data.num_epoch is None and cfg.eval.skip_before_train
    assert cfg.logging.use_tensorboard and not cfg.logging.use_wandb
    assert cfg.reward.custom_rm_kwargs == '{"format_weight": 0.5}' and cfg.algo.kl_loss_type == "k1"
    ratio = build_config(["--config", str(write_config(tmp_path, edit={"worker.actor.optim.lr_warmup_ratio": 0.1}))],
                         check_paths=False)
    assert ratio.optimizer.lr_warmup_fraction == 0.1 and ratio.optimizer.lr_warmup_iters == 0


def test_online_filtering_keeps_groups_whose_mean_lies_between_low_and_high(tmp_path):
    from slime_rl.data import Sample

    edit = {"algorithm.online_filtering": True, "algorithm.filter_key": "accuracy", "algorithm.filter_low": 0.2,
            "algorithm.filter_high": 0.8}
    cfg = build_config(["--config", str(write_config(tmp_path, edit=edit))], check_paths=False)
    keep = load_filter(cfg.rollout.dynamic_sampling_filter_path, None, cfg.rollout.dynamic_sampling_filter_kwargs)

    def group(accuracies):
        return [Sample(index=i, group_index=0, prompt="", prompt_ids=[1], reward=0.0,
                       reward_metrics={"accuracy": a}) for i, a in enumerate(accuracies)]
    # EasyR1: keep when filter_low < mean < filter_high (ray_trainer.py); means 0.5, 0.2, 0.8, 1.0, 0.25
    assert [keep(group(a)) for a in ([0, 1], [0.2, 0.2], [0.8, 0.8], [1, 1], [0, 0, 0, 1])] == \
        [True, False, False, False, True]


@pytest.mark.slow
def test_dry_run_of_the_geo3k_example_with_a_tiny_vl_model(tmp_path, tiny_qwen2_5_vl, capsys):
    from slime_rl.data.vl_counting import make_rows, write_jsonl
    from slime_rl.train import main

    # a full batch of the example's rollout_batch_size (512 prompts)
    train = write_jsonl(make_rows(512, seed=1, image_dir=tmp_path / "img", size=56), tmp_path / "train.jsonl")
    val = write_jsonl(make_rows(4, seed=2, image_dir=tmp_path / "img_val", size=56), tmp_path / "val.jsonl")
    path = write_config(tmp_path, model=str(tiny_qwen2_5_vl), train=str(train), val=str(val))
    assert main(["--config", str(path), "--dry-run", "--run-dir", str(tmp_path / "run"), "--cluster", "1x8"]) == 0
    out = capsys.readouterr().out
    assert "worker.rollout.tensor_parallel_size -> --rollout-num-gpus-per-engine 2" in out
    # 8 trainer ranks and, on the same 8 devices (EasyR1's hybrid engine: --colocate), 4 engines of 2 (SGLang's
    # command lines, TP 2, memory fraction 0.6)
    assert "worker.hybrid_engine -> --colocate" in out
    engines = [line for line in out.splitlines() if line.startswith("engine ")]
    assert len(engines) == 4 and all("--tp-size 2" in e and "--mem-fraction-static 0.6" in e for e in engines)


def test_num_rollout_on_the_command_line_wins_over_the_files_epochs(tmp_path):
    cfg = build_config(["--config", str(write_config(tmp_path)), "--num-rollout", "2"], check_paths=False)
    assert cfg.rollout.num_rollout == 2 and cfg.data.num_epoch is None
    flat = tmp_path / "flat.yaml"
    flat.write_text("num-rollout: 3\n")
    cfg = build_config(["--config", str(flat), "--hf-checkpoint", "m", "--prompt-data", "d", "--rm-type", "digit",
                        "--rollout-batch-size", "2", "--num-epoch", "1"], check_paths=False)
    assert cfg.data.num_epoch == 1


@pytest.mark.parametrize("loss_type", ["gspo", "gspo_token", "cispo", "sapo"])
def test_easyr1_loss_types_with_grpo_are_our_estimators(tmp_path, loss_type):
    """EasyR1's worker.actor.loss_type gspo / gspo_token / cispo / sapo (its core_algos.compute_policy_loss) with
    adv_estimator grpo: --advantage-estimator of that name (gspo_token: gspo, the same loss with one advantage
    per sample, tests/algo/test_cispo_sapo.py); clip_ratio_low/high stay the clip bounds (CISPO's weight bounds);
    the dual clip caps gspo and gspo_token as EasyR1's code applies it (its default 3.0 when the file leaves it
    out) and is dropped for cispo and sapo, which take no PPO minimum; SAPO takes tau_positive / tau_negative."""
    edit = {"worker.actor.loss_type": loss_type, "worker.actor.tau_positive": 0.5, "worker.actor.tau_negative": 2.0}
    cfg = build_config(["--config", str(write_config(tmp_path, edit=edit))], check_paths=False)
    gspo = loss_type.startswith("gspo")
    assert cfg.algo.advantage_estimator == ("gspo" if gspo else loss_type)
    assert cfg.algo.eps_clip_c == (3.0 if gspo else None)
    assert (cfg.algo.eps_clip, cfg.algo.eps_clip_high) == (0.2, 0.3)  # the fixture's clip ratios
    want = (0.5, 2.0) if loss_type == "sapo" else (1.0, 1.05)  # the taus are SAPO's only
    assert (cfg.algo.sapo_tau_pos, cfg.algo.sapo_tau_neg) == want


@pytest.mark.parametrize("edit, want", [
    ({"worker.actor.model.lora.rank": 8}, (8, 64.0, ("all-linear",))),  # geo3k's alpha 64, `.*visual.*` excluded
    ({"worker.actor.model.lora.rank": 8, "worker.actor.model.lora.alpha": None,
      "worker.actor.model.lora.target_modules": None}, (8, 16.0, ("all-linear",))),  # EasyR1's LoraConfig defaults
    ({"worker.actor.model.lora.rank": 16, "worker.actor.model.lora.alpha": 32,
      "worker.actor.model.lora.target_modules": "q_proj,v_proj"}, (16, 32.0, ("q_proj", "v_proj"))),
    ({"worker.actor.model.lora.rank": 4, "worker.actor.model.lora.target_modules": ["o_proj", "down_proj"]},
     (4, 64.0, ("o_proj", "down_proj"))),
])
def test_lora_maps_to_the_lora_flags(tmp_path, edit, want):
    cfg = build_config(["--config", str(write_config(tmp_path, edit=edit))], check_paths=False)
    assert (cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_target_modules) == want
