"""A command line slime-rl cannot read is refused with a sentence that names the flag and what to do,
exit 2, before anything starts: never argparse's bare "unrecognized arguments" or "invalid choice"."""

from __future__ import annotations

import pytest

from slime_rl.config import ConfigError, build_config
from slime_rl.config.flags import FLAGS
from slime_rl.train import main as train_main
from tests.config.test_config import base_argv


def _refusal(tmp_path, *extra: str) -> str:
    with pytest.raises(ConfigError) as info:
        build_config(base_argv(tmp_path) + list(extra))
    text = str(info.value)
    assert "unrecognized arguments" not in text and "invalid choice" not in text, text
    return text


def test_an_unknown_flag_is_named_with_the_closest_flags_and_where_to_look(tmp_path, capsys):
    code = train_main(base_argv(tmp_path) + ["--rollout-batch-sizes", "3", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--rollout-batch-sizes is not a flag of slime-rl train" in err
    assert "did you mean --rollout-batch-size" in err and "docs/migration.md" in err
    assert "'3'" not in err  # the unknown flag's value is not reported as a stray one
    assert "unrecognized arguments" not in err


def test_several_unknown_flags_and_a_stray_value_are_each_named(tmp_path):
    text = _refusal(tmp_path, "--not-a-flag-here", "1", "2", "--also-not-one=4")
    assert "--not-a-flag-here is not a flag" in text and "--also-not-one is not a flag" in text
    assert "'2' is a value with no flag before it" in text and "'1'" not in text
    assert "did you mean" not in text.split(";")[0]  # nothing close to it


def test_an_unknown_flags_value_with_spaces_is_its_value_not_a_stray_one(tmp_path):
    # slime's geo3k script: --multimodal-keys '{"image": "images"}' (one argv token holding a space)
    text = _refusal(tmp_path, "--not-a-flag-here", '{"image": "images"}')
    assert "--not-a-flag-here is not a flag" in text and "no flag before it" not in text, text


@pytest.mark.parametrize("flag", [f for f in FLAGS if f.choices and f.action is None], ids=lambda f: f.name)
def test_a_value_outside_the_choices_names_the_flag_and_every_choice(tmp_path, flag):
    text = _refusal(tmp_path, flag.name, "no-such-value")
    assert text.startswith(f"{flag.name} 'no-such-value': not a value it takes here"), text
    assert all(repr(c) in text for c in flag.choices), text


@pytest.mark.parametrize("flag", [f for f in FLAGS if f.action is None and not f.choices and f.nargs is None
                                  and f.type in (int, float)], ids=lambda f: f.name)
def test_a_number_flag_given_a_word_says_it_wants_a_number(tmp_path, flag):
    text = _refusal(tmp_path, flag.name, "abc")
    want = "an integer" if flag.type is int else "a number"
    assert text == f"{flag.name} 'abc': expected {want}", text


def test_a_flag_without_its_value_and_a_switch_with_one(tmp_path):
    assert _refusal(tmp_path, "--lr") == "--lr needs a value"
    assert _refusal(tmp_path, "--colocate=yes") == "--colocate is a switch: it takes no value (got 'yes')"
    assert _refusal(tmp_path, "--micro-batch-size", "abc") == "--micro-batch-size 'abc': expected a positive integer"


def test_sglang_server_flags_without_a_backend_choose_sglang_and_say_why(tmp_path, capsys):
    """slime's scripts never pass --rollout-backend (slime always runs SGLang) and do pass SGLang's flags."""
    with pytest.warns(UserWarning, match=r"--rollout-backend sglang: --sglang-mem-fraction-static is an SGLang "
                                         r"server flag, which the built-in engine does not take"):
        cfg = build_config(base_argv(tmp_path) + ["--sglang-mem-fraction-static", "0.7"])
    assert cfg.engine.backend == "sglang" and cfg.engine.sglang_args == {"mem_fraction_static": "0.7"}
    with pytest.warns(UserWarning, match="--rollout-num-gpus-per-engine 2 needs a multi-GPU engine"):
        cfg = build_config(base_argv(tmp_path) + ["--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2"])
    assert cfg.engine.backend == "sglang"
    # the flags the built-in engine takes keep it; an explicit backend is obeyed (and refuses what it cannot take)
    assert build_config(base_argv(tmp_path) + ["--sglang-enable-torch-compile"]).engine.backend == "embedded"
    with pytest.raises(ConfigError, match="--sglang-mem-fraction-static: SGLang's server flags, but "
                                          "--rollout-backend is embedded"):
        build_config(base_argv(tmp_path) + ["--rollout-backend", "embedded", "--sglang-mem-fraction-static", "0.7"])
    # the command line prints it as the run's first line, not as a Python warning
    train_main(base_argv(tmp_path) + ["--sglang-mem-fraction-static", "0.7", "--dry-run", "--cluster", "1x8"])
    err = capsys.readouterr().err
    assert err.startswith("slime-rl train: note: --rollout-backend sglang: --sglang-mem-fraction-static"), err


def test_eval_requests_take_eval_top_k_else_the_rollouts(tmp_path):
    """slime's --eval-top-k; unset, eval samples with --rollout-top-k as it does with the other --rollout-*
    sampling flags (before it, eval requests carried no top_k at all and so used the whole vocabulary)."""
    from slime_rl.rollout.eval import eval_sampling_params

    base = base_argv(tmp_path) + ["--eval-interval", "1", "--eval-prompt-data", "d", base_argv(tmp_path)[3]]
    assert eval_sampling_params(build_config(base).eval)["top_k"] == -1
    assert eval_sampling_params(build_config(base + ["--rollout-top-k", "5"]).eval)["top_k"] == 5
    params = eval_sampling_params(build_config(base + ["--rollout-top-k", "5", "--eval-top-k", "1",
                                                       "--eval-top-p", "0.5"]).eval)
    assert (params["top_k"], params["top_p"]) == (1, 0.5)
    assert _refusal(tmp_path, "--eval-top-k", "0").startswith("--eval-top-k must be -1 (whole vocabulary) or in")


def test_slimes_runtime_flags_that_change_nothing_here_are_accepted_and_change_nothing(tmp_path, capsys):
    # a fixed --run-dir: the default is named by the second the config is built, which may differ between builds
    argv = base_argv(tmp_path) + ["--run-dir", str(tmp_path / "run")]
    base = build_config(argv)
    same = build_config(argv + ["--log-probs-chunk-size", "1024", "--allgather-cp"])
    assert same == base, {k: (v, base.to_dict()[k]) for k, v in same.to_dict().items() if v != base.to_dict()[k]}
    with pytest.warns(UserWarning, match="--sequence-parallel with --tensor-model-parallel-size 1: off"):
        tp1 = build_config(argv + ["--sequence-parallel"])
    assert tp1 == base and not tp1.trainer.sequence_parallel, tp1.trainer
    tp2 = build_config(base_argv(tmp_path) + ["--sequence-parallel", "--tensor-model-parallel-size", "2",
                                              "--actor-num-gpus-per-node", "2"])
    assert tp2.trainer.sequence_parallel
    # a note of load.py prints as the command line's note too, as parse.py's does
    train_main(base_argv(tmp_path) + ["--sequence-parallel", "--dry-run", "--cluster", "1x8"])
    err = capsys.readouterr().err  # (a library's own warning may come first: a line of its own)
    assert any(line.startswith("slime-rl train: note: --sequence-parallel with") for line in err.splitlines()), err
