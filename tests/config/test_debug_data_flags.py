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
