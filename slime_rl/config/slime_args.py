"""What slime's extension functions get as `args`, and slime's extension flags we do not have.

slime calls its extension functions with its parsed argparse Namespace first (`rm(args, sample)`,
`generate(args, sample, sampling_params)`, `filter(args, samples)`). Our flags already carry
slime's and Megatron's names, so `slime_args(cfg)` is the Namespace of every flag of the table
under its own name, with the value the run uses (defaults and derived values filled in), plus
the attributes slime's own `generate` reads: `sglang_router_ip` / `sglang_router_port` (set by the
rollout to an HTTP endpoint in front of our engines, see `slime_rl.rollout.slime_compat`),
`sglang_enable_deterministic_inference`, `sglang_dp_size`, `rollout_global_dataset`, `ci_test`,
`use_rollout_routing_replay`, and every `--sglang-<name>` pass-through as `sglang_<name>`.

`SLIME_ONLY_FLAGS`: slime's extension flags that have no counterpart here, each with the reason
and what to use instead; `load.py` refuses them by name (command line or YAML) before parsing.
"""

from __future__ import annotations

import argparse
import operator
from typing import Any

from slime_rl.config.flags import FLAGS

# slime's flag -> why it has no counterpart here (and what does the job instead)
SLIME_ONLY_FLAGS: dict[str, str] = {
    # --rollout-function-path is a flag of ours (flags_from_slime.py): accepted with slime's default rollout only
    "--eval-function-path": "evaluation runs the built-in generate on --eval-prompt-data",
    "--buffer-filter-path": "there is no sample buffer between rollout and training: each step trains on the "
    "groups its rollout kept (--dynamic-sampling-filter-path chooses them)",
    "--rollout-sample-filter-path": "no per-sample remove_sample: drop whole groups with "
    "--dynamic-sampling-filter-path, or give tokens loss_mask 0 in a custom generate function",
    "--rollout-all-samples-process-path": "filtered groups are only counted (rollout/groups_filtered); "
    "--dump-rollouts writes the kept samples",
    "--rollout-data-postprocess-path": "the batch goes from the rollout to the trainer unchanged; set loss masks "
    "in a custom generate function",
    "--rollout-sample-hook-path": "no per-sample hook; a custom generate function can change the sample it returns",
    "--custom-loss-function-path": "the policy loss is fixed by --advantage-estimator and --loss-agg-mode "
    "(slime_rl.algo.losses)",
    "--custom-pg-loss-reducer-function-path": "--loss-agg-mode chooses the reduction (Dr.GRPO: "
    "seq-mean-token-sum-norm)",
    "--custom-advantage-function-path": "advantages come from --advantage-estimator (slime_rl.algo.estimators)",
    "--custom-convert-samples-to-train-data-path": "samples become the trainer's batch in one fixed way "
    "(orchestration.rollout_manager.samples_to_batch)",
    "--custom-rollout-log-function-path": "metrics go to <run-dir>/metrics.jsonl and the --use-wandb / "
    "--use-tensorboard / --use-swanlab backends; --dump-rollouts writes every kept sample",
    "--custom-eval-rollout-log-function-path": "eval metrics go to metrics.jsonl like the others",
    "--data-source-path": "prompts come from --prompt-data (jsonl / json / parquet)",
    "--custom-megatron-init-path": "the trainer exposes no Megatron hooks",
    "--custom-megatron-before-log-prob-hook-path": "the trainer exposes no Megatron hooks",
    "--custom-megatron-before-train-step-hook-path": "the trainer exposes no Megatron hooks",
    "--custom-model-provider-path": "the model is built from the --hf-checkpoint architecture",
    "--custom-update-weight-post-write-path": "no publishing step for a filesystem without read-after-write "
    "consistency: --update-weight-transport disk writes plain files that the engines' hosts read as they are",
    # slime's own training modes and transports (slime 624b824's scripts/ and examples/)
    "--fp8-format": "FP8 training needs TransformerEngine, which this trainer does not use: it trains in bf16 "
    "(the engines may still serve an FP8 checkpoint)",
    "--fp8-recipe": "FP8 training needs TransformerEngine (see --fp8-format)",
    "--loss-mask-type": "multi-turn loss masks come from a custom generate function (each sample's loss_mask), "
    "not from a chat-template rule",
}


def refuse_slime_only(names: list[str], where: str, error: type[Exception]) -> None:
    """Raise `error` for the first of `names` (flags or YAML keys) that is one of `SLIME_ONLY_FLAGS`."""
    for raw in names:
        name = "--" + str(raw).lstrip("-").partition("=")[0].replace("_", "-")
        if name in SLIME_ONLY_FLAGS:
            raise error(f"{where}{name} is slime's and has no counterpart here: {SLIME_ONLY_FLAGS[name]}")


def _value(cfg: Any, group: str, field: str) -> Any:
    holder = cfg if group == "" else getattr(cfg, group, None)
    return None if holder is None else getattr(holder, field, None)


def slime_args(cfg: Any, **extra: Any) -> argparse.Namespace:
    """A `Config` as slime's `args`: each flag's key (`--rollout-max-response-len` ->
    `args.rollout_max_response_len`) with the value the run uses; `extra` overrides/adds attributes."""
    ns = argparse.Namespace()
    for f in FLAGS:
        targets = f.targets + f.derived_targets
        if not targets:
            continue
        value = _value(cfg, *targets[0])
        if targets[0] == ("model", "megatron_model_args"):  # slime's MODEL_ARGS: each flag under its own name
            value = (value or {}).get(f.name, f.default)
        if value is None and targets[0][0] == "critic":
            value = f.default
        if f.convert is operator.not_:  # --disable-grpo-std-normalization stores its negation
            value = not value
        elif f.action is not None:
            value = bool(value) if f.name != "--deterministic-rollout" else value is not None
        elif f.name == "--eval-prompt-data":
            value = [x for pair in value for x in pair] or None
        elif isinstance(value, tuple):
            value = list(value) or None
        setattr(ns, f.key, value)
    sglang = dict(getattr(getattr(cfg, "engine", None), "sglang_args", None) or {})
    for name, value in sglang.items():
        setattr(ns, f"sglang_{name}", value)
    defaults = {"sglang_router_ip": None, "sglang_router_port": None, "sglang_dp_size": None,
                "sglang_enable_deterministic_inference": bool(ns.deterministic_rollout),
                "rollout_global_dataset": True, "ci_test": False, "use_rollout_routing_replay": False,
                "rollout_skip_special_tokens": False, "apply_chat_template_kwargs": None}
    for name, value in defaults.items():
        if not hasattr(ns, name):
            setattr(ns, name, value)
    for name, value in extra.items():
        setattr(ns, name, value)
    return ns
