"""Fixtures of the trainer tests: tiny checkpoints, scenario runs (cached for the session, so
test modules share one run per scenario), HF float64 references."""

from __future__ import annotations

import pytest

from tests.trainer.trainer_ref import (
    hf_entropy,
    hf_logprobs,
    hf_model,
    hf_policy_grad,
    make_batch,
    make_tiny_qwen3,
    masked_token_mean,
)
from tests.trainer.trainer_scenarios import scenario_runner


@pytest.fixture(scope="session")
def ckpts(tiny_qwen2, tiny_llama, tiny_qwen3_moe, tmp_path_factory) -> dict:
    from tests.conftest import _load_tool

    four = _load_tool("make_tiny_model").make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_4l"), num_layers=4)
    return {"qwen2": tiny_qwen2, "llama": tiny_llama,
            "qwen3": make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3")), "qwen3_moe": tiny_qwen3_moe,
            "qwen2_4l": four}


@pytest.fixture(scope="session")
def scenario(ckpts, tmp_path_factory):
    return scenario_runner(tmp_path_factory.mktemp("trainer_scenarios"), ckpts)


@pytest.fixture(scope="session")
def ref(ckpts):
    """HF float64 references on the fixed batch."""
    batch = make_batch()
    out = {}
    for name, ckpt in ckpts.items():
        model = hf_model(ckpt)
        out[f"{name}/logp_t07"] = hf_logprobs(model, batch, temperature=0.7)
        if name == "qwen2_4l":  # only the uneven pipeline split uses it
            out["qwen2_4l/logp"] = hf_logprobs(model, batch)
            out["qwen2_4l/loss"], out["qwen2_4l/grad"] = hf_policy_grad(model, batch)
            continue
        if name == "qwen2":
            out["logp"] = hf_logprobs(model, batch)
            out["entropy_mean"] = masked_token_mean(hf_entropy(model, batch), batch)
            out["loss"], out["grad"] = hf_policy_grad(model, batch)
    return out


