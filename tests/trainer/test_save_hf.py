"""--save-hf: the trainer writes its weights as an HF folder that transformers loads.

Scenario (checkpoint_scenarios.save_hf): tied tiny Qwen2 at PP=2 (two gloo processes, one layer
per stage, the embedding on stage 0 and its output-layer copy on stage 1), one training step,
a write over a stale `.tmp` left by an "interrupted" earlier write, another step, a second write
to the same path. Expected values come from the trainer itself (each stage's `iter_hf_weights`,
the weight-sync path) and from the source folder, not from the writer under test.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from slime_rl.config import ConfigError, build_config
from tests.config.test_config import base_argv
from tests.conftest import free_port
from tests.trainer.checkpoint_scenarios import run_scenario


@pytest.fixture(scope="module")
def saved(tiny_qwen2, tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("save_hf")
    out = base / "hf_3"
    recs = run_scenario("save_hf", 2, free_port(), base, {"hf": str(tiny_qwen2), "tp": 1, "pp": 2, "out": str(out)})
    return {"base": base, "out": out, "recs": recs}


@pytest.mark.slow
def test_folder_is_complete_and_atomic(saved, tiny_qwen2):
    base, out = saved["base"], saved["out"]
    assert [r["path"] for r in saved["recs"]] == [str(out)] * 2
    # the stale temporary folder was replaced, the first write swapped out: only the final folder
    assert sorted(p.name for p in base.iterdir() if p.name.startswith("hf_")) == ["hf_3"]
    assert not (out / "junk").exists()
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (tiny_qwen2 / f).read_bytes(), f
    assert json.loads((out / "config.json").read_text()) == json.loads((tiny_qwen2 / "config.json").read_text())


@pytest.mark.slow
def test_transformers_loads_the_trainer_weights(saved, tiny_qwen2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stages = {r["pp_rank"]: r["stage"] for r in saved["recs"]}
    assert set(stages) == {0, 1} and not set(stages[0]) & set(stages[1])  # every stage contributes its own
    trainer = stages[0] | stages[1]
    source = load_file(tiny_qwen2 / "model.safetensors")
    assert set(trainer) == set(source) and "lm_head.weight" not in trainer  # tied: one tensor
    assert any(not torch.equal(trainer[n], t) for n, t in source.items())  # training moved the weights

    model = AutoModelForCausalLM.from_pretrained(saved["out"], dtype=torch.float32)
    state = model.state_dict()
    for name, t in trainer.items():
        assert torch.equal(state[name], t), name
    assert torch.equal(state["lm_head.weight"], trainer["model.embed_tokens.weight"])
    tok = AutoTokenizer.from_pretrained(saved["out"])
    assert tok("1 2 3")["input_ids"] == AutoTokenizer.from_pretrained(tiny_qwen2)("1 2 3")["input_ids"]


def test_save_hf_flag(tmp_path):
    ckpt = build_config(base_argv(tmp_path) + ["--save-hf", str(tmp_path / "hf_{rollout_id}"),
                                               "--save-interval", "2"]).checkpoint
    assert ckpt.hf_path(4) == str(tmp_path / "hf_4")
    # --num-rollout 3: after steps 1 (interval) and 2 (the last)
    assert [s for s in range(3) if ckpt.saves_at(s, 3)] == [1, 2]
    # {rollout_id.x} escaped as an AttributeError, and {rollout_id.real} passed, before the check was
    # the debug dumps' (config/checks.py _check_path_template)
    for bad in ("hf_{step}", "hf_{rollout_id.x}", "hf_{rollout_id.real}", "hf_{0}", "hf_{"):
        with pytest.raises(ConfigError, match=r"--save-hf .*placeholder allowed is \{rollout_id\}"):
            build_config(base_argv(tmp_path) + ["--save-hf", str(tmp_path / bad)])
    assert not build_config(base_argv(tmp_path)).checkpoint.saves_at(2, 3)
