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
    (["--use-opd"], "--use-opd needs --opd-type: megatron .* or sglang"),
    (["--opd-type", "megatron"], "--opd-type / --opd-teacher-load need --use-opd"),
    (["--use-opd", "--opd-type", "megatron"], "--opd-type megatron needs --opd-teacher-load"),
    (["--use-opd", "--opd-type", "sglang"], "--opd-type sglang needs --rm-url: the teacher server's /generate URL"),
    (["--use-opd", "--opd-type", "sglang", "--rm-url", "http://t/generate", "--opd-teacher-load", "x"],
     "--opd-teacher-load x is --opd-type megatron's teacher"),
    (["--custom-reward-post-process-path", "slime.rollout.on_policy_distillation.post_process_rewards"],
     "--custom-reward-post-process-path .* needs --use-opd --opd-type sglang"),
    (["--custom-reward-post-process-path", "my.post_process"],
     "--custom-reward-post-process-path .*must be slime.rollout.on_policy_distillation.post_process_rewards"),
    (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/nowhere"],
     "--opd-teacher-load /nowhere: no such folder"),
])
def test_incomplete_or_unbuilt_distillation_is_refused_naming_the_flag(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        build_config(_base(tmp_path) + extra)


def test_slimes_teacher_server_distillation_is_taken(tmp_path):
    """slime's examples/on_policy_distillation/run-qwen3-8B-opd.sh: its reward function and post-process name the
    teacher call; here they are --opd-type sglang with the teacher at --rm-url (tests/rollout/test_opd_teacher.py)."""
    base = [a for a in _base(tmp_path) if a not in ("--rm-type", "digit")]
    cfg = build_config(base + ["--use-opd", "--opd-type", "sglang", "--opd-kl-coef", "1.0",
                               "--rm-url", "http://10.0.0.5:13141/generate",
                               "--custom-rm-path", "slime.rollout.on_policy_distillation.reward_func",
                               "--custom-reward-post-process-path",
                               "slime.rollout.on_policy_distillation.post_process_rewards"])
    assert (cfg.algo.opd_type, cfg.reward.rm_url) == ("sglang", "http://10.0.0.5:13141/generate")
    with pytest.raises(ConfigError, match="reward_func posts each sample to a teacher server: it is --use-opd "
                                          "--opd-type sglang here"):
        build_config(base + ["--custom-rm-path", "slime.rollout.on_policy_distillation.reward_func"])
