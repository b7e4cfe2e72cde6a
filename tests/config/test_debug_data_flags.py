"""slime's --save-debug-rollout-data / --save-debug-train-data: path templates whose placeholders are
checked before anything starts (slime formats them with rollout_id, and rank for the train data)."""

from __future__ import annotations

import warnings

import pytest

from slime_rl.config import ConfigError, build_config
from slime_rl.train import main as train_main
from tests.config.test_config import base_argv

ROLLOUT, TRAIN = "--save-debug-rollout-data", "--save-debug-train-data"


def test_templates_land_in_the_debug_group_and_format_like_slimes(tmp_path):
    cfg = build_config(
        base_argv(tmp_path) + [ROLLOUT, "/d/rollout_{rollout_id}.pt", TRAIN, "/d/{rollout_id}_{rank}.pt"]
    )
    assert cfg.debug.rollout_data_path(7) == "/d/rollout_7.pt"
    assert cfg.debug.train_data_path(7, 1) == "/d/7_1.pt"
    plain = build_config(base_argv(tmp_path) + [ROLLOUT, "/d/last.pt", TRAIN, "/d/{{x}}_{rank}.pt"])  # no placeholder
    assert plain.debug.rollout_data_path(3) == "/d/last.pt" and plain.debug.train_data_path(3, 0) == "/d/{x}_0.pt"
    off = build_config(base_argv(tmp_path))
    assert off.debug.save_rollout_data is None and off.debug.save_train_data is None


@pytest.mark.parametrize(
    "flag, template, words",
    [
        (
            TRAIN,
            "/x/{step}.pt",
            "placeholder {step} is not allowed: the placeholders allowed are {rollout_id} and {rank}",
        ),
        (ROLLOUT, "/x/{rank}.pt", "placeholder {rank} is not allowed: the only placeholder allowed is {rollout_id}"),
        (ROLLOUT, "/x/{}.pt", "placeholder {} is not allowed"),
        (ROLLOUT, "/x/{0}.pt", "placeholder {0} is not allowed"),
        (TRAIN, "/x/{rollout_id.real}.pt", "placeholder {rollout_id.real} is not allowed"),
        (TRAIN, "/x/{rank.pt", "not a path template"),
        (ROLLOUT, "/x/{rollout_id:s}.pt", "not a path template for numbers"),
        (ROLLOUT, "/x/{rollout_id:{rank}}.pt", "not a path template for numbers"),
    ],
)
def test_a_bad_placeholder_is_refused_naming_the_flag(tmp_path, flag, template, words):
    with pytest.raises(ConfigError) as err:
        build_config(base_argv(tmp_path) + [flag, template])
    message = str(err.value)
    assert message.startswith(f"{flag} {template!r}: ") and words in message, message


def test_the_command_line_stops_before_anything_starts(tmp_path, capsys):
    assert train_main(base_argv(tmp_path) + [TRAIN, str(tmp_path / "{step}.pt")]) == 2
    err = capsys.readouterr().err
    assert "--save-debug-train-data" in err and "{step}" in err
    assert not list(tmp_path.glob("*.pt"))


def test_train_data_without_rank_on_several_dp_ranks_warns_and_is_kept(tmp_path):
    dp2 = base_argv(tmp_path) + ["--actor-num-gpus-per-node", "2"]
    with pytest.warns(UserWarning, match=r"has no \{rank\}: the 2 data-parallel ranks write the same file"):
        assert build_config(dp2 + [TRAIN, "/d/{rollout_id}.pt"]).debug.save_train_data == "/d/{rollout_id}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_config(dp2 + [TRAIN, "/d/{rollout_id}_{rank}.pt"])
        build_config(base_argv(tmp_path) + [TRAIN, "/d/{rollout_id}.pt"])  # one DP rank: one file


# ---- --load-debug-rollout-data (slime's replay) and --debug-train-only
LOAD = "--load-debug-rollout-data"


def test_load_template_formats_like_slimes_and_makes_the_run_train_only(tmp_path):
    cfg = build_config(base_argv(tmp_path) + [LOAD, "/d/rollout_{rollout_id}.pt"])
    assert cfg.debug.load_rollout_data == "/d/rollout_{rollout_id}.pt"
    assert cfg.debug.load_rollout_path(4) == "/d/rollout_4.pt"
    assert cfg.debug.train_only
    # no engine: nothing for the placement, the cluster or --dry-run to start
    assert cfg.engine.num_gpus == 0 and cfg.engine.num_engines == 0 and not cfg.engine.colocate
    both = build_config(base_argv(tmp_path) + [LOAD, "/d/{rollout_id}.pt", "--debug-train-only"])
    assert both.debug.train_only and both.debug.load_rollout_data == "/d/{rollout_id}.pt"
    off = build_config(base_argv(tmp_path))
    assert off.debug.load_rollout_data is None and not off.debug.train_only and off.engine.num_gpus == 1


def test_load_template_with_a_bad_placeholder_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(ConfigError) as err:
        build_config(base_argv(tmp_path) + [LOAD, "/x/{rank}.pt"])
    message = str(err.value)
    assert message.startswith(f"{LOAD} '/x/{{rank}}.pt': "), message
    assert "the only placeholder allowed is {rollout_id}" in message


def test_debug_train_only_alone_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ConfigError) as err:
        build_config(base_argv(tmp_path) + ["--debug-train-only"])
    message = str(err.value)
    assert message.startswith("--debug-train-only needs --load-debug-rollout-data"), message
    assert "SFT" in message


def test_train_only_keeps_the_generation_flags_checked_and_drops_the_colocated_engines(tmp_path):
    colocated = base_argv(tmp_path) + ["--colocate", "--actor-num-gpus-per-node", "2", "--global-batch-size", "4",
                                       "--micro-batch-size", "2"]
    assert build_config(colocated).engine.colocate
    cfg = build_config(colocated + [LOAD, "/d/{rollout_id}.pt"])
    assert not cfg.engine.colocate and cfg.engine.num_engines == 0
    with pytest.raises(ConfigError, match="--colocate and --async exclude each other"):  # the script is still checked
        build_config(colocated + [LOAD, "/d/{rollout_id}.pt", "--async"])


def test_eval_is_skipped_with_a_warning_in_a_train_only_run(tmp_path):
    (tmp_path / "eval.jsonl").write_text('{"input": "y", "label": "2"}\n')
    evals = base_argv(tmp_path) + ["--eval-prompt-data", "small", str(tmp_path / "eval.jsonl"), "--eval-interval", "1"]
    assert build_config(evals).eval.enabled
    with pytest.warns(UserWarning, match="--eval-prompt-data small: eval is skipped with --load-debug-rollout-data"):
        cfg = build_config(evals + [LOAD, "/d/{rollout_id}.pt"])
    assert not cfg.eval.enabled and cfg.eval.datasets == ()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_config(base_argv(tmp_path) + [LOAD, "/d/{rollout_id}.pt"])  # no eval asked: no warning


def test_slime_style_args_see_train_only_as_slime_sets_it(tmp_path):
    from slime_rl.config.slime_args import slime_args

    args = slime_args(build_config(base_argv(tmp_path) + [LOAD, "/d/{rollout_id}.pt"]))
    assert args.load_debug_rollout_data == "/d/{rollout_id}.pt" and args.debug_train_only is True
    assert slime_args(build_config(base_argv(tmp_path))).debug_train_only is False
