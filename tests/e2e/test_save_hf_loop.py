"""--save-hf in the real loop (Ray, Megatron TP=2 on gloo, the built-in engine): a 2-step run with
--save-interval 1 and no --save writes one HF folder per step, named from the {rollout_id}
template. The trainer-level equality (folder == the trainer's gathered weights, PP=2) is in
tests/trainer/test_save_hf.py; here the wiring through flags, train.py, the cluster and the actors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from slime_rl.config import build_config
from slime_rl.train import preflight, train
from tests.e2e.test_loop import argv
from tests.loop_checks import digit_data_fixture

digit_data = digit_data_fixture(32, seed=1)


@pytest.mark.slow
def test_save_hf_every_interval(ray_session, tiny_qwen2, digit_data, tmp_path):
    from transformers import AutoModelForCausalLM

    rows = train(*preflight(build_config(argv(tiny_qwen2, digit_data, tmp_path / "run", steps=2) + [
        "--save-hf", str(tmp_path / "hf" / "step_{rollout_id}"), "--save-interval", "1"])))
    assert [r["step"] for r in rows] == [0, 1] and "perf/save_s" in rows[0]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["step_0", "step_1"]
    source = load_file(tiny_qwen2 / "model.safetensors")
    saved = [load_file(tmp_path / "hf" / f"step_{i}" / "model.safetensors") for i in (0, 1)]
    for s in saved:
        assert set(s) == set(source)
    if any(r["train/grad_norm"] > 0 for r in rows):  # an update happened: the folders track it
        assert any(not torch.equal(saved[1][n], t) for n, t in source.items())
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "step_1", dtype=torch.float32)
    assert all(torch.equal(model.state_dict()[n], t) for n, t in saved[1].items())
