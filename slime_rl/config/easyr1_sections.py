"""EasyR1's `data`, `algorithm` and `trainer` sections as our flags, one function per section over an
`EasyR1Context` (config/easyr1_context.py); the `worker.*` sections are in config/easyr1_worker.py and
the order they run in is config/easyr1.py's SECTION_MAPPERS."""

from __future__ import annotations

import json
from typing import Any

from slime_rl.config.easyr1_context import EasyR1Context
from slime_rl.config.estimators import estimator_spec

_ESTIMATORS = {"grpo": "grpo", "gae": "ppo", "reinforce_plus_plus": "reinforce_plus_plus", "rloo": "rloo"}
_KL_TYPES = {"kl": "k1", "mse": "k2", "low_var_kl": "low_var_kl"}  # EasyR1's kl_penalty -> --kl-loss-type
_LOGGERS = {"wandb": "use_wandb", "swanlab": "use_swanlab", "tensorboard": "use_tensorboard"}


def map_data(ctx: EasyR1Context) -> None:
    """`data.*`: the train / val files, row keys, lengths, batch size, shuffling and image sizes."""
    m, get, fail, rule, to, na, only = ctx.m, ctx.get, ctx.fail, ctx.rule, ctx.to, ctx.na, ctx.only

    def train_files(v: Any) -> None:
        text = str(v)
        if "@" in text and not text.split("@", 1)[1].startswith("["):
            fail("data.train_files", f"{text!r} names a Hub dataset split (<name>@<split>); give a local jsonl / json "
                 "/ parquet file")
        m.set("data.train_files", "prompt_data", text)
    rule("data.train_files", train_files)

    def val_files(v: Any) -> None:
        if not v:
            m.na("data.val_files", "unset")
        elif int(get("trainer.val_freq", -1)) <= 0:
            m.na("data.val_files", "trainer.val_freq is -1: no validation")
        else:
            text = str(v)
            if "@" in text and not text.split("@", 1)[1].startswith("["):
                fail("data.val_files", f"{text!r} names a Hub dataset split; give a local file")
            m.set("data.val_files", "eval_prompt_data", ["val", text])
    rule("data.val_files", val_files)
    m.set("data (EasyR1 always applies the chat template)", "apply_chat_template", True)
    to("data.prompt_key", "input_key")
    to("data.answer_key", "label_key")
    to("data.image_key", "image_key")
    na("data.video_key", "videos are not supported: only --image-key is read from a row")
    na("data.video_fps", "videos are not supported")
    only("data.image_dir", lambda v: v is None, "unset", "no counterpart: image paths are read relative to the data "
         "file's folder (or absolute); make the paths in the rows so")
    to("data.max_prompt_length", "rollout_max_prompt_len")
    to("data.max_response_length", "rollout_max_response_len")
    to("data.rollout_batch_size", "rollout_batch_size")
    to("data.mini_rollout_batch_size", "over_sampling_batch_size")
    na("data.val_batch_size", "eval requests are batched by the engines (--sglang-server-concurrency)")
    to("data.format_prompt", "format_prompt")
    only("data.override_chat_template", lambda v: v is None, "unset", "no counterpart: the checkpoint's chat template "
         "is used (edit chat_template in its tokenizer_config.json)")
    to("data.shuffle", "rollout_shuffle", bool)
    to("data.seed", "rollout_seed", int)
    to("data.min_pixels", "min_pixels", int)
    to("data.max_pixels", "max_pixels", int)
    na("data.filter_overlong_prompts", "prompts longer than --rollout-max-prompt-len are always dropped")
    na("data.filter_overlong_prompts_workers", "data loading parallelism")


# EasyR1's worker.actor.loss_type values that are one of our estimators (with adv_estimator grpo). gspo (the
# sequence-level ratio on each token) and gspo_token (its token form) have the same value and gradient with one
# advantage per sample, as GRPO gives (algo/gspo.py): both are --advantage-estimator gspo
_LOSS_TYPES = {"gspo": "gspo", "gspo_token": "gspo", "cispo": "cispo", "sapo": "sapo"}


def map_algorithm(ctx: EasyR1Context) -> None:
    """`algorithm.*` (with worker.actor.loss_type): the advantage estimator, the KL and online filtering."""
    m, get, fail, rule, to, na, only = ctx.m, ctx.get, ctx.fail, ctx.rule, ctx.to, ctx.na, ctx.only
    given, estimator = ctx.given, ctx.estimator

    def adv(v: Any) -> None:
        loss_type = str(get("worker.actor.loss_type", "default"))
        if v not in _ESTIMATORS:
            fail("algorithm.adv_estimator", f"{v!r} has no counterpart (--advantage-estimator: "
                 f"{', '.join(sorted(_ESTIMATORS))} of EasyR1's)")
        ours = _ESTIMATORS[v]
        if loss_type in _LOSS_TYPES:  # GRPO's advantages with another loss: one estimator here
            if v != "grpo":
                fail("worker.actor.loss_type", f"{loss_type} with adv_estimator {v}: it is available with grpo only")
            ours = _LOSS_TYPES[loss_type]
        elif loss_type != "default":
            fail("worker.actor.loss_type", f"{loss_type!r} has no counterpart (default, "
                 f"{', '.join(sorted(_LOSS_TYPES))} do)")
        m.set("algorithm.adv_estimator", "advantage_estimator", ours,
              f"with worker.actor.loss_type {loss_type}" if loss_type in _LOSS_TYPES else "EasyR1's default" if
              "algorithm.adv_estimator" not in given else "")
    rule("algorithm.adv_estimator", adv)
    ctx.handled.add("worker.actor.loss_type")
    to("algorithm.gamma", "gamma", float)
    to("algorithm.lam", "lambd", float)

    def kl(_: Any) -> None:
        coef, penalty = float(get("algorithm.kl_coef")), str(get("algorithm.kl_penalty"))
        if get("algorithm.disable_kl"):
            m.na("algorithm.kl_coef", "algorithm.disable_kl: no reference model, no KL")
            return
        if "algorithm.disable_kl" in given:
            m.na("algorithm.disable_kl", "false: the KL below applies")
        if get("algorithm.kl_type", "fixed") != "fixed":
            fail("algorithm.kl_type", f"{get('algorithm.kl_type')!r}: only a fixed KL coefficient is supported")
        if get("algorithm.use_kl_loss"):
            if penalty not in _KL_TYPES:
                fail("algorithm.kl_penalty", f"{penalty!r} has no counterpart (--kl-loss-type: "
                     f"{', '.join(f'{k} -> {v}' for k, v in _KL_TYPES.items())})")
            m.set("algorithm.use_kl_loss", "use_kl_loss", True)
            m.set("algorithm.kl_coef", "kl_loss_coef", coef)
            m.set("algorithm.kl_penalty", "kl_loss_type", _KL_TYPES[penalty])
            return
        ours = _LOSS_TYPES.get(str(get("worker.actor.loss_type", "default")), _ESTIMATORS.get(estimator, estimator))
        if not estimator_spec(ours).kl_in_rewards:
            fail("algorithm.use_kl_loss", f"false puts the KL (algorithm.kl_coef {coef}) in the rewards, which "
                 f"--advantage-estimator {ours} does not do here; set use_kl_loss: true or disable_kl: true")
        m.set("algorithm.kl_coef", "kl_coef", coef, "KL in the rewards (algorithm.use_kl_loss false)")
        if penalty != "kl":
            m.na("algorithm.kl_penalty", "the KL in the rewards is log-ratio (EasyR1's kl)")
    rule("algorithm.kl_coef", kl)
    ctx.handled.update({"algorithm.disable_kl", "algorithm.use_kl_loss", "algorithm.kl_penalty"})
    only("algorithm.kl_type", lambda v: v == "fixed", "fixed coefficient", "only 'fixed' is supported")
    na("algorithm.kl_horizon", "adaptive KL controller only")
    na("algorithm.kl_target", "adaptive KL controller only")

    def online(v: Any) -> None:
        if not v:
            for k in ("algorithm.online_filtering", "algorithm.filter_key", "algorithm.filter_low",
                      "algorithm.filter_high"):
                if k in given:
                    m.na(k, "online filtering is off")
            return
        key = str(get("algorithm.filter_key", "overall"))
        kwargs = {"key": None if key == "overall" else key, "low": float(get("algorithm.filter_low", 0.01)),
                  "high": float(get("algorithm.filter_high", 0.99))}
        m.set("algorithm.online_filtering", "dynamic_sampling_filter_path",
              "slime_rl.rollout.filters.reward_mean_in_range")
        m.set("algorithm.filter_key/low/high", "dynamic_sampling_filter_kwargs", json.dumps(kwargs))
    rule("algorithm.online_filtering", online)
    ctx.handled.update({"algorithm.filter_key", "algorithm.filter_low", "algorithm.filter_high"})
    na("trainer.max_try_make_batch", "a rollout that has drawn every prompt 3 times without filling its batch stops "
       "the run (rollout_manager.MAX_EPOCHS_PER_ROLLOUT)")


def map_trainer(ctx: EasyR1Context) -> None:
    """`trainer.*`: length of the run, loggers, devices, validation and checkpoints."""
    m, get, rule, to, na, only = ctx.m, ctx.get, ctx.rule, ctx.to, ctx.na, ctx.only
    given, critic, estimator = ctx.given, ctx.critic, ctx.estimator
    save_freq, save_path = ctx.save_freq, ctx.save_path

    def epochs(v: Any) -> None:
        if get("trainer.max_steps") is not None:
            m.na("trainer.total_epochs", "trainer.max_steps wins")
        else:
            m.set("trainer.total_epochs", "num_epoch", int(v), "" if "trainer.total_epochs" in given
                  else "EasyR1's default")
    rule("trainer.total_epochs", epochs)
    to("trainer.max_steps", "num_rollout", int)

    def project(v: Any) -> None:
        m.set("trainer.project_name", "wandb_project", str(v))
        m.set("trainer.project_name", "swanlab_project", str(v))
    rule("trainer.project_name", project)
    to("trainer.experiment_name", "wandb_group", str)

    def loggers(v: Any) -> None:
        for name in [v] if isinstance(v, str) else list(v or []):
            if name in _LOGGERS:
                m.set("trainer.logger", _LOGGERS[name], True, name)
            else:
                m.na(f"trainer.logger {name}", "metrics always go to <run-dir>/metrics.jsonl" if name in
                     ("console", "file") else "not supported; metrics.jsonl is still written")
    rule("trainer.logger", loggers)

    def nodes(_: Any) -> None:
        nn, per = int(get("trainer.nnodes", 1)), int(get("trainer.n_gpus_per_node", 8))
        m.set("trainer.nnodes", "actor_num_nodes", nn)
        m.set("trainer.n_gpus_per_node", "actor_num_gpus_per_node", per)
        if get("worker.hybrid_engine", True):  # EasyR1's default: actor and engines take turns on every GPU
            m.set("worker.hybrid_engine", "colocate", True, "the engines on the trainer's GPUs, released while it "
                  "trains" + ("" if "worker.hybrid_engine" in given else " (EasyR1's default)"))
            m.set("trainer.nnodes x n_gpus_per_node", "rollout_num_gpus", nn * per, "the trainer's GPUs")
        else:
            m.set("trainer.nnodes x n_gpus_per_node", "rollout_num_gpus", nn * per,
                  "without the hybrid engine, the engines get GPUs of their own")
    rule("trainer.nnodes", nodes)
    if "trainer.nnodes" not in ctx.cfg:
        rule("trainer.n_gpus_per_node", nodes)
    ctx.handled.update(("trainer.n_gpus_per_node", "worker.hybrid_engine"))

    def critic_warmup(v: Any) -> None:
        if critic:
            m.set("trainer.critic_warmup", "num_critic_only_steps", int(v))
        else:
            m.na("trainer.critic_warmup", f"no critic for adv_estimator {estimator}")
    rule("trainer.critic_warmup", critic_warmup)

    def val_freq(v: Any) -> None:
        if int(v) <= 0:
            m.na("trainer.val_freq", "-1: no validation")
        elif not get("data.val_files"):
            m.na("trainer.val_freq", "no data.val_files")
        else:
            m.set("trainer.val_freq", "eval_interval", int(v))
    rule("trainer.val_freq", val_freq)

    def val_before(v: Any) -> None:
        if v:
            m.na("trainer.val_before_train", "true, the default")
        else:
            m.set("trainer.val_before_train", "skip_eval_before_train", True)
    rule("trainer.val_before_train", val_before)
    only("trainer.val_only", lambda v: not v, "false", "validation-only runs are not supported")

    def generations(v: Any) -> None:
        if int(v) > 0:
            m.set("trainer.val_generations_to_log", "log_eval_generations", int(v),
                  "N eval samples per eval to <run-dir>/eval_generations.jsonl (and wandb's table)")
        else:
            m.na("trainer.val_generations_to_log", "0")
    rule("trainer.val_generations_to_log", generations)

    def save(v: Any) -> None:
        if int(v) <= 0:
            m.na("trainer.save_freq", "-1: no checkpoints")
            return
        m.set("trainer.save_freq", "save_interval", int(v))
        m.set("trainer.save_checkpoint_path", "save", str(save_path),
              "" if get("trainer.save_checkpoint_path") else "EasyR1's default checkpoints/<project>/<experiment>")
    rule("trainer.save_freq", save)
    ctx.handled.add("trainer.save_checkpoint_path")

    def save_limit(v: Any) -> None:
        if int(v) <= 0 or save_freq <= 0:
            m.na("trainer.save_limit", "no limit" if int(v) <= 0 else "no checkpoints")
        else:
            m.set("trainer.save_limit", "keep_last", int(v))
    rule("trainer.save_limit", save_limit)
    na("trainer.save_model_only", "checkpoints keep the optimizer state (a run resumes from them); --save-hf adds "
       "HF weights")
    to("trainer.load_checkpoint_path", "load", str)

    def find_last(v: Any) -> None:
        if v and get("trainer.load_checkpoint_path") is None and save_freq > 0:
            m.set("trainer.find_last_checkpoint", "load", str(save_path), "auto-resume from --save")
        else:
            m.na("trainer.find_last_checkpoint", "off" if not v else "no checkpoints to resume from")
    rule("trainer.find_last_checkpoint", find_last)
    na("trainer.ray_timeline", "Ray timeline dumps")
