"""slime's on-policy distillation flags (--use-opd, --opd-type, --opd-kl-coef, --opd-teacher-load): what the
config takes and the sentences that refuse the rest, before anything starts (the math and the teacher's
forward: tests/trainer/test_ref_load.py)."""

from __future__ import annotations

import pytest

from slime_rl.config import ConfigError, build_config


def _base(tmp):
    (tmp / "model").mkdir(exist_ok=True)
    (tmp / "model" / "config.json").write_text("{}")
    (tmp / "teacher").mkdir(exist_ok=True)
    (tmp / "d.jsonl").write_text('{"input": "1", "label": "1"}\n')
    return ["--hf-checkpoint", str(tmp / "model"), "--prompt-data", str(tmp / "d.jsonl"), "--rollout-batch-size", "4",
            "--num-rollout", "1", "--rm-type", "digit"]


def test_megatron_teacher_is_taken(tmp_path):
    cfg = build_config(_base(tmp_path) + ["--use-opd", "--opd-type", "megatron", "--opd-kl-coef", "0.25",
                                          "--opd-teacher-load", str(tmp_path / "teacher")])
    assert (cfg.algo.use_opd, cfg.algo.opd_type, cfg.algo.opd_kl_coef) == (True, "megatron", 0.25)
    assert cfg.model.opd_teacher_load == str(tmp_path / "teacher")


@pytest.mark.parametrize("extra,message", [
    (["--use-opd"], "--use-opd needs --opd-type megatron"),
    (["--opd-type", "megatron"], "--opd-type / --opd-teacher-load need --use-opd"),
    (["--use-opd", "--opd-type", "megatron"], "--opd-type megatron needs --opd-teacher-load"),
    (["--use-opd", "--opd-type", "sglang"], "--opd-type sglang: the teacher's log-probs from its own SGLang server"),
    (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/nowhere"],
     "--opd-teacher-load /nowhere: no such folder"),
])
def test_incomplete_or_unbuilt_distillation_is_refused_naming_the_flag(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        build_config(_base(tmp_path) + extra)
