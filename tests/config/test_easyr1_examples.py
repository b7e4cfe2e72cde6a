"""EasyR1's own example scripts (hiyouga/EasyR1 examples/*.sh, their command lines in
tests/migration/easyr1_examples.json, extracted by tools/easyr1_examples.py): each one's `config=... key=value`
overrides, as written, go to `slime-rl train` (paths to models, datasets and reward files made local), dry-run
on the GPUs the script asks for. The examples the acceptance names (examples/config.yaml as
qwen2_5_7b_math_grpo.sh runs it, and the DAPO, GSPO, SAPO and CISPO ones) plan on EasyR1's 8 GPUs: EasyR1's hybrid
engine is --colocate, its tensor-parallel engines on the trainer's GPUs."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from slime_rl.config import build_config
from slime_rl.config.easyr1 import CLI_TOKEN
from tests.conftest import _load_tool

tool = _load_tool("easyr1_examples")
CORPUS = tool.load_corpus()
SCRIPTS = [r["script"] for r in CORPUS["scripts"]]
NAMED = ["examples/qwen2_5_7b_math_grpo.sh", "examples/qwen2_5_vl_7b_geo3k_dapo.sh",
         "examples/qwen3_14b_dapo17k_dapo.sh", "examples/qwen2_5_vl_7b_geo3k_gspo.sh",
         "examples/qwen2_5_vl_7b_geo3k_sapo.sh", "examples/qwen2_5_vl_7b_geo3k_cispo.sh"]


@pytest.fixture(scope="module")
def measured() -> dict[str, dict]:
    return {rec["script"]: tool.run_example(rec) for rec in CORPUS["scripts"]}


def test_corpus_is_easyr1s_command_lines():
    assert re.fullmatch(r"[0-9a-f]{40}", CORPUS["commit"]) and len(SCRIPTS) == len(set(SCRIPTS)) >= 20
    for rec in CORPUS["scripts"]:
        assert rec["overrides"][0] == "config=examples/config.yaml", rec["script"]
        assert all(CLI_TOKEN.match(tok) for tok in rec["overrides"]), rec["script"]
    assert set(NAMED) <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_outcome_is_the_documented_one(script, measured):
    row, recorded = measured[script], tool.docs_outcomes()
    assert row["outcome"] != "traceback", row["output"][-3000:]
    assert recorded.get(script) == row["outcome"], (
        f"{script}: {row['outcome']} now ({row['reason']}), {recorded.get(script)} in docs/migration.md; "
        "regenerate: python tools/easyr1_examples.py --table --docs")


@pytest.mark.parametrize("script", NAMED)
def test_named_examples_plan_on_eight_gpus_with_colocated_engines(script, measured):
    row = measured[script]
    assert row["outcome"] == "plans", row["reason"]
    engines = [line for line in row["output"].splitlines() if line.startswith("engine ")]
    tp = {"examples/qwen3_14b_dapo17k_dapo.sh": 4}.get(script, 2)  # worker.rollout.tensor_parallel_size
    assert len(engines) == 8 // tp and all(f"--tp-size {tp}" in e for e in engines)
    devices = sorted(int(d) for e in engines for d in e.split("CUDA_VISIBLE_DEVICES=")[1].split()[0].split(","))
    assert devices == list(range(8))  # the trainer's 8 GPUs, shared
    assert "colocated" in row["output"]


def config_of(script: str):
    rec = next(r for r in CORPUS["scripts"] if r["script"] == script)
    with tempfile.TemporaryDirectory() as tmp:
        argv, why = tool.local_argv(rec, Path(tmp))
        assert argv is not None, why
        return build_config(argv[:argv.index("--dry-run")], check_paths=False)


def test_values_as_easyr1_reads_the_command_line():
    """OmegaConf's reading of the overrides, then EasyR1's meaning, by hand from each script: CISPO's
    clip_ratio_low=0 and clip_ratio_high=4 are its weight's bounds [1, 5]; GSPO's 3e-4 / 4e-4 (floats for
    OmegaConf, strings for plain YAML); DAPO on dapo17k: its reward's three keyword arguments from the JSON
    string, n 16 x global_batch_size 32 prompts = 512 samples a step, dual clip 10."""
    cispo = config_of("examples/qwen2_5_vl_7b_geo3k_cispo.sh")
    assert (cispo.algo.advantage_estimator, cispo.algo.eps_clip, cispo.algo.eps_clip_high) == ("cispo", 0.0, 4.0)
    assert cispo.engine.colocate
    gspo = config_of("examples/qwen2_5_vl_7b_geo3k_gspo.sh")
    assert (gspo.algo.advantage_estimator, gspo.algo.eps_clip, gspo.algo.eps_clip_high) == ("gspo", 3e-4, 4e-4)
    dapo = config_of("examples/qwen3_14b_dapo17k_dapo.sh")
    assert dapo.reward.custom_rm_kwargs == ('{"max_response_length": 20480, "overlong_buffer_length": 4096, '
                                            '"overlong_penalty_factor": 1.0}')
    assert dapo.rollout.n_samples_per_prompt == 16 and dapo.batch.global_batch_size == 512
    assert dapo.algo.eps_clip_c == 10.0 and dapo.engine.colocate


def test_easyr1_command_line_and_a_flags_file_are_one_or_the_other(tmp_path):
    from slime_rl.config import ConfigError

    flags = tmp_path / "flags.yaml"
    flags.write_text("lr: 1.0e-6\n")
    with pytest.raises(ConfigError, match=r"--config .*flags.yaml and EasyR1.s command line \(config=x.yaml .*one"):
        build_config(["--config", str(flags), "config=x.yaml", "worker.actor.loss_type=cispo"], check_paths=False)
    with pytest.raises(ConfigError, match=r"config=.*flags.yaml: not EasyR1's layout"):
        build_config([f"config={flags}", "worker.actor.loss_type=cispo"], check_paths=False)
    with pytest.raises(ConfigError, match=r"config= is given 2 times"):
        build_config([f"config={flags}", f"config={flags}"], check_paths=False)
