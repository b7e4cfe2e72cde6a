"""The flag table (config/flags.FLAGS) walked flag by flag: every flag parses, lands in the group
field(s) it names, and the default `--help` shows is the field's default."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from pathlib import Path

import pytest

from slime_rl.config import Config, build_config
from slime_rl.config.flags import FLAGS, Flag, build_parser
from slime_rl.config.groups import GROUPS


def _base(tmp: Path) -> list[str]:
    (tmp / "model").mkdir(exist_ok=True)
    (tmp / "model" / "config.json").write_text("{}")
    (tmp / "d.jsonl").write_text('{"input": "1", "label": "1"}\n')
    return ["--hf-checkpoint", str(tmp / "model"), "--prompt-data", str(tmp / "d.jsonl"),
            "--rollout-batch-size", "4", "--num-rollout", "3", "--rm-type", "digit"]


def _get(cfg: Config, group: str, field: str):
    return getattr(cfg if group == "" else getattr(cfg, group), field)


# flags whose generic non-default value (below) is refused, or that need another flag to be accepted
VALUES = {"--eps-clip-c": ["3"], "--rollout-rs": ["token_k1"], "--rollout-rs-threshold": ["2"],
          "--rollout-top-k": ["5"], "--min-lr": ["1e-7"], "--rm-type": ["math"],
          "--rollout-stop": ["a", "b"], "--rollout-stop-token-ids": ["3", "5"]}
VALUES["--cluster"] = ["2x8"]
COMPANIONS = {
    "--tensor-model-parallel-size": ["--actor-num-gpus-per-node", "2"],
    "--pipeline-model-parallel-size": ["--actor-num-gpus-per-node", "2"],
    "--context-parallel-size": ["--actor-num-gpus-per-node", "2"],
    "--enable-mtp-training": ["--mtp-num-layers", "1"],  # the MTP layers it trains
    "--sequence-parallel": ["--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"],
    "--use-dynamic-batch-size": ["--max-tokens-per-gpu", "64"],
    "--save-interval": ["--save", "ckpt"], "--keep-last": ["--save", "ckpt"],
    "--exit-signal-handler": ["--save", "ckpt"],
    "--rollout-num-gpus-per-engine": ["--rollout-backend", "sglang", "--rollout-num-gpus", "2"],
    "--sglang-router-port": ["--use-sglang-router"],
    "--mask-offpolicy-in-partial-rollout": ["--partial-rollout"],
    "--group-rm": ["--custom-rm-path", "m:f"],
    "--kl-coef": ["--advantage-estimator", "reinforce_plus_plus"],
    "--ref-update-interval": ["--use-kl-loss"],
    "--tis-level": ["--use-tis"], "--tis-mode": ["--use-tis"], "--max-staleness": ["--fully-async"],
    "--rollout-rs": ["--rollout-rs-threshold", "2"], "--rollout-rs-threshold": ["--rollout-rs", "token_k1"],
    "--tis-batch-normalize": ["--use-tis"],
    "--critic-lr-warmup-iters": ["--advantage-estimator", "ppo"],
    "--critic-save": ["--advantage-estimator", "ppo", "--save", "ckpt"],
    "--num-critic-only-steps": ["--advantage-estimator", "ppo"],
    "--critic-load": ["--advantage-estimator", "ppo"],
    "--cluster": ["--dry-run"],
    "--expert-model-parallel-size": ["--actor-num-gpus-per-node", "2"],
    "--expert-tensor-parallel-size": ["--actor-num-gpus-per-node", "2"],
    # on-policy distillation: the type and the teacher go together (the teacher's folder on a cluster)
    "--use-opd": ["--opd-type", "megatron", "--opd-teacher-load", "/teacher", "--dry-run", "--cluster", "1x8"],
    "--opd-type": ["--use-opd", "--opd-teacher-load", "/teacher", "--dry-run", "--cluster", "1x8"],
    "--opd-teacher-load": ["--use-opd", "--opd-type", "megatron"],
    # the adapters' settings need adapters
    "--lora-alpha": ["--lora-rank", "8"], "--lora-dropout": ["--lora-rank", "8"],
    "--lora-target-modules": ["--lora-rank", "8"],
    # the file transport needs its folder; delta mode also the engine hosts' folder
    "--update-weight-transport": ["--update-weight-disk-dir", "/shared/sync"],
    "--update-weight-mode": ["--update-weight-transport", "disk", "--update-weight-disk-dir", "/shared/sync",
                             "--update-weight-local-checkpoint-dir", "/nvme/ckpt"],
    "--update-weight-disk-dir": ["--update-weight-transport", "disk"],
    "--update-weight-local-checkpoint-dir": ["--update-weight-transport", "disk", "--update-weight-disk-dir", "/s"],
    "--update-weight-disk-keep-files": ["--update-weight-transport", "disk", "--update-weight-disk-dir", "/s"],
    # prefill/decode engines are SGLang's, and need a decode engine beside the prefill ones
    "--prefill-num-servers": ["--rollout-backend", "sglang", "--rollout-num-gpus", "3"],
    "--sglang-config": ["--rollout-backend", "sglang", "--rollout-num-gpus", "2"],
}
OPTIONAL_PACKAGES = {"--use-wandb": "wandb", "--use-tensorboard": "tensorboard", "--use-swanlab": "swanlab"}


def _value(f: Flag, tmp: Path) -> list[str]:
    """Command-line tokens giving `f` a valid value different from its default."""
    if f.action is not None:
        return []
    if f.name in VALUES:
        return VALUES[f.name]
    if f.name in ("--load", "--critic-load", "--ref-load", "--opd-teacher-load"):
        return [str(tmp)]
    if f.name == "--sglang-config":  # slime's server groups: one prefill and one decode engine
        groups = tmp / "groups.yaml"
        groups.write_text("sglang: [{name: actor, server_groups: [{worker_type: prefill, num_gpus: 1}, "
                          "{worker_type: decode, num_gpus: 1}]}]\n")
        return [str(groups)]
    if f.choices is not None:
        return [next(str(c) for c in f.choices if c != f.default)]
    if f.type is None:
        return ["x"]
    if f.type is float or f.type.__name__.endswith("_float"):
        return ["0.25" if f.default == 0.5 else "0.5"]
    return [str(2 if f.default is None else f.default + 1)]


DIRECT = [f for f in FLAGS if f.targets and not f.required]


@pytest.mark.parametrize("f", DIRECT, ids=[f.name for f in DIRECT])
def test_every_flag_lands_in_its_field(f: Flag, tmp_path):
    if f.name in OPTIONAL_PACKAGES and importlib.util.find_spec(OPTIONAL_PACKAGES[f.name]) is None:
        pytest.skip(f"{OPTIONAL_PACKAGES[f.name]} is not installed")
    base = _base(tmp_path)
    if f.name == "--num-epoch":  # instead of --num-rollout
        base = base[:base.index("--num-rollout")] + base[base.index("--num-rollout") + 2:]
    if f.name == "--log-eval-generations":  # logs eval samples: needs an eval set (a file that exists)
        base += ["--eval-interval", "1", "--eval-prompt-data", "d", base[base.index("--prompt-data") + 1]]
    given = [f.name, *_value(f, tmp_path)]
    cfg = build_config(base + COMPANIONS.get(f.name, []) + given)
    # the value as argparse reads it, then the table's conversion (e.g. a list -> a tuple)
    parsed = build_parser().parse_args(base + given)
    expected = f.value(parsed)
    assert expected != f.field_default, f"{f.name}: the test value must differ from the default"
    for group, field in f.targets:
        assert _get(cfg, group, field) == expected, (f.name, group, field)


@pytest.mark.parametrize("f", DIRECT, ids=[f.name for f in DIRECT])
def test_help_default_is_the_field_default(f: Flag, tmp_path):
    action = next(a for a in build_parser()._actions if f.name in a.option_strings)
    shown = action.default  # what --help and docs/flags.md show
    for group, field in f.targets:
        cls_fields = {x.name: x for x in dataclasses.fields(GROUPS[group])}
        converted = shown if f.convert is None else f.convert(shown)
        assert cls_fields[field].default == converted, (f.name, group, field)
    # and a run without the flag holds it (critic fields exist only with a critic)
    if any(g == "critic" for g, _ in f.targets):
        cfg = build_config(_base(tmp_path) + ["--advantage-estimator", "ppo"])
    else:
        cfg = build_config(_base(tmp_path))
    for group, field in f.targets:
        if f.name not in _base(tmp_path):
            assert _get(cfg, group, field) == f.field_default, (f.name, group, field)


def test_required_flags_land_in_their_fields(tmp_path):
    base = _base(tmp_path)
    cfg = build_config(base)
    for f in (f for f in FLAGS if f.required):
        raw = base[base.index(f.name) + 1]
        for group, field in f.targets:
            assert _get(cfg, group, field) == (raw if f.type is None else f.type(raw)), f.name


def _derived_cases(tmp: Path) -> dict[tuple[str, str, str], tuple[list[str], object]]:
    """(flag, group, field) -> (extra argv, expected field value): the fields load.py computes."""
    data = str(tmp / "d.jsonl")
    ppo = ["--advantage-estimator", "ppo"]
    return {
        ("--global-batch-size", "batch", "global_batch_size"): (["--global-batch-size", "4"], 4),
        ("--num-steps-per-rollout", "batch", "global_batch_size"): (["--num-steps-per-rollout", "2"], 2),
        ("--rollout-max-response-len", "eval", "max_response_len"): (["--rollout-max-response-len", "9"], 9),
        ("--rollout-temperature", "eval", "temperature"): (["--rollout-temperature", "0.5"], 0.5),
        ("--rollout-top-p", "eval", "top_p"): (["--rollout-top-p", "0.5"], 0.5),
        # the run seed (config/seeds.py), by hand: 7 * 1_000_033 + 42, 1234 * 1_000_033 + 7, 1234 * 1_000_033 + 42
        ("--seed", "data", "seed"): (["--seed", "7"], 7_000_273),
        ("--seed", "rollout", "sample_seed"): (["--seed", "7", "--deterministic-rollout"], 7_000_273),
        ("--rollout-seed", "data", "seed"): (["--rollout-seed", "7"], 1_234_040_729),
        ("--rollout-seed", "rollout", "sample_seed"): (["--rollout-seed", "7", "--deterministic-rollout"],
                                                       1_234_040_729),
        ("--deterministic-rollout", "rollout", "sample_seed"): (["--deterministic-rollout"], 1_234_040_764),
        ("--num-rollout", "rollout", "num_rollout"): (["--num-rollout", "5"], 5),
        ("--eval-prompt-data", "eval", "datasets"): (["--eval-interval", "1", "--eval-prompt-data", "a", data],
                                                     (("a", data),)),
        ("--eval-config", "eval", "datasets"): (["--eval-interval", "1", "--eval-config", _eval_yaml(tmp)],
                                                (("a", data),)),
        ("--eval-config", "eval", "settings"): (["--eval-interval", "1", "--eval-config", _eval_yaml(tmp)],
                                                {"a": {"top_k": 5, "temperature": 0.0}}),
        ("--eval-temperature", "eval", "temperature"): (["--eval-temperature", "0.5"], 0.5),
        ("--multimodal-keys", "data", "image_key"): (["--multimodal-keys", '{"image": "pictures"}'], "pictures"),
        ("--eval-top-p", "eval", "top_p"): (["--eval-top-p", "0.5"], 0.5),
        ("--eval-top-k", "eval", "top_k"): (["--eval-top-k", "3"], 3),
        ("--rollout-top-k", "eval", "top_k"): (["--rollout-top-k", "7"], 7),
        ("--eval-max-response-len", "eval", "max_response_len"): (["--eval-max-response-len", "9"], 9),
        ("--rollout-num-gpus", "engine", "num_gpus"): (["--rollout-num-gpus", "2"], 2),
        ("--eps-clip-high", "algo", "eps_clip_high"): (["--eps-clip-high", "0.3"], 0.3),
        ("--critic-num-nodes", "critic", "num_nodes"): (ppo + ["--critic-num-nodes", "2"], 2),
        ("--critic-num-gpus-per-node", "critic", "num_gpus_per_node"): (ppo + ["--critic-num-gpus-per-node", "2"], 2),
        ("--critic-lr", "critic", "lr"): (ppo + ["--critic-lr", "0.5"], 0.5),
        ("--run-dir", "logging", "run_dir"): (["--run-dir", "somewhere"], "somewhere"),
        # accepted only with the replay, which implies it (tests/config/test_debug_data_flags.py)
        ("--debug-train-only", "debug", "train_only"): (["--debug-train-only", "--load-debug-rollout-data", "x"],
                                                        True),
        # slime's MODEL_ARGS: each flag given lands in the dict under its name, nothing else does
        **{(name, "model", "megatron_model_args"): (tokens, {name: value})
           for name, (tokens, value) in _model_args_cases().items()},
    }


def _eval_yaml(tmp: Path) -> str:
    """An --eval-config file: one set `a` of d.jsonl, top_k 5 from defaults and its own temperature 0."""
    path = tmp / "eval.yaml"
    path.write_text(f"eval:\n  defaults:\n    top_k: 5\n  datasets:\n    - name: a\n      path: {tmp / 'd.jsonl'}\n"
                    "      temperature: 0.0\n")
    return str(path)


def _model_args_cases() -> dict[str, tuple[list[str], object]]:
    """A MODEL_ARGS flag -> (argv giving it, the value kept): a switch True, a number as its type reads it."""
    from slime_rl.config.flags_model import MODEL_FLAGS

    special = {"--moe-layer-freq": (["([0]*1+[1]*2)"], [0, 1, 1]), "--spec": (["local"], ["local"]),
               "--moe-router-dtype": (["fp32"], "fp32"), "--normalization": (["RMSNorm"], "RMSNorm"),
               "--moe-router-bias-update-rate": (["0"], 0.0)}
    cases = {}
    for f in MODEL_FLAGS:
        if f.name in special:
            tokens, value = special[f.name]
        elif f.action is not None:
            tokens, value = [], True
        elif f.choices is not None:
            tokens, value = [f.choices[-1]], f.choices[-1]
        elif f.type is float or f.type.__name__.endswith("_float"):
            tokens, value = ["0.5"], 0.5
        else:
            tokens, value = ["3"], 3
        cases[f.name] = ([f.name, *tokens], value)
    return cases


def test_every_derived_field_is_computed_from_its_flag(tmp_path):
    cases = _derived_cases(tmp_path)
    declared = {(f.name, g, x) for f in FLAGS for g, x in f.derived_targets}
    assert declared == set(cases), "a derived field of the flag table has no case here (or a case is stale)"
    base = _base(tmp_path)
    for (name, group, field), (extra, expected) in cases.items():
        argv = list(base)
        if name == "--num-rollout":
            i = argv.index("--num-rollout")
            argv = argv[:i] + argv[i + 2:]
        cfg = build_config(argv + extra)
        assert _get(cfg, group, field) == expected, (name, group, field)


def test_flag_fallbacks_for_derived_fields(tmp_path):
    """Without their own flag the derived fields follow the flag they default to."""
    cfg = build_config(_base(tmp_path) + ["--eps-clip", "0.1", "--rollout-temperature", "0.7",
                                          "--rollout-max-response-len", "11"])
    assert cfg.algo.eps_clip_high == 0.1
    assert (cfg.eval.temperature, cfg.eval.max_response_len, cfg.trainer.loss_agg_max_len) == (0.7, 11, 11)
    assert cfg.rollout.samples_per_rollout == 4 * 1
    assert cfg.rollout.sample_seed is None


def test_a_renamed_field_fails_at_import():
    """groups._check_table refuses a table that names a field its group does not have."""
    from slime_rl.config import groups

    broken = dataclasses.replace(next(f for f in FLAGS if f.name == "--rollout-top-p"), to="rollout.topp")
    saved = groups.FLAGS
    try:
        groups.FLAGS = (*FLAGS, broken)
        with pytest.raises(TypeError, match=r"--rollout-top-p lands in RolloutConfig.topp"):
            groups._check_table()
    finally:
        groups.FLAGS = saved


def test_every_flag_is_in_the_table_once():
    names = [s for a in build_parser()._actions for s in a.option_strings if s not in ("-h", "--help")]
    assert sorted(names) == sorted(f.name for f in FLAGS)
    assert isinstance(build_parser(), argparse.ArgumentParser)
