"""An agent harness that knows only the `openai` client (tests/plugins/openai_agent.py) trains through the
whole loop on CPU: Ray, a Megatron rank on gloo, the built-in engine; each sample is one two-turn
trajectory recorded token for token through the rollout's OpenAI endpoint (the exactness itself is
checked against the engine and the template in tests/rollout/test_agent.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from slime_rl.config import build_config
from slime_rl.train import preflight, train
from tests.conftest import ROOT
from tests.e2e.test_loop import argv
from tests.loop_checks import digit_data_fixture

digit_data = digit_data_fixture(32, seed=4)
TASKSET_FILE = ROOT / "tests" / "rollout" / "vf_two_turns.py"


@pytest.mark.slow
def test_an_openai_client_harness_trains_two_steps(ray_session, tiny_qwen2, digit_data, tmp_path):
    args = argv(tiny_qwen2, digit_data, tmp_path / "run", steps=2) + [
        "--tensor-model-parallel-size", "1", "--actor-num-gpus-per-node", "1", "--rollout-max-response-len", "64",
        "--custom-generate-function-path", "tests.plugins.openai_agent:agent", "--dump-rollouts"]
    rows = train(*preflight(build_config(args)))
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["rollout/agent_turns_mean"] == 2.0 and row["rollout/agent_failed_frac"] == 0.0
        assert row["rollout/agent_branched_frac"] == 0.0
        assert np.isfinite(row["train/loss"]) and np.isfinite(row["train/grad_norm"])
        # the trainer's log-probs of the sampled tokens are the engine's: the same tokens in the same context
        assert row["train/rollout_logprob_abs_diff"] <= (1e-3 if row["step"] == 0 else 1e-2)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    check = tok.decode(tok.encode("Check it."))  # as the tiny tokenizer keeps it (its alphabet is small)
    dumped = [json.loads(x) for x in (tmp_path / "run" / "rollouts" / "step_000000.jsonl").read_text().splitlines()]
    assert len(dumped) == 16
    for d in dumped:  # the second user turn sits inside the response
        assert check in d["response"] and d["reward"] in (0.0, 1.0)


@pytest.mark.slow
def test_a_textarena_game_trains_two_steps(ray_session, tiny_qwen2, digit_data, tmp_path):
    """--agent-env textarena:GuessTheNumber-v0: TextArena's own game, unchanged, one episode per sample."""
    args = argv(tiny_qwen2, digit_data, tmp_path / "run", steps=2) + [
        "--tensor-model-parallel-size", "1", "--actor-num-gpus-per-node", "1", "--rollout-max-response-len", "300",
        "--agent-env", "textarena:GuessTheNumber-v0", "--agent-max-turns", "3", "--agent-turn-max-tokens", "16",
        "--dump-rollouts"]
    rows = train(*preflight(build_config(args)))
    for row in rows:
        assert 1.0 <= row["rollout/agent_turns_mean"] <= 3.0 and row["rollout/agent_failed_frac"] == 0.0
        assert 0.0 <= row["rollout/reward_mean"] <= 1.0  # TextArena's reward: closeness of the last guess
        assert np.isfinite(row["train/loss"]) and np.isfinite(row["train/grad_norm"])
    dumped = [json.loads(x) for x in (tmp_path / "run" / "rollouts" / "step_000000.jsonl").read_text().splitlines()]
    assert len(dumped) == 16 and all("Guess" in d["prompt"] for d in dumped)


@pytest.mark.slow
def test_a_verifiers_environment_trains_two_steps(ray_session, tiny_qwen2, digit_data, tmp_path):
    """--agent-env verifiers:TASKSET: a verifiers 0.4.0 environment, unchanged, through the whole loop (its own
    two-turn Env and rubric, tests/rollout/vf_two_turns.py, given as its file; verifiers' null
    harness in its subprocess runtime): every sample two turns, none failed, the reward its rubric's (0.5 x the
    words of the last answer), two steps trained. 2 prompts x 2 samples a step: each episode starts verifiers'
    programs, ~1 s each on 2 cores."""
    args = argv(tiny_qwen2, digit_data, tmp_path / "run", steps=2) + [
        "--tensor-model-parallel-size", "1", "--actor-num-gpus-per-node", "1", "--rollout-max-response-len", "64",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--micro-batch-size",
        "4", "--agent-env", f'verifiers:{TASKSET_FILE}:{{"agent":{{"harness":{{"id":"null"}}}}}}',
        "--agent-turn-max-tokens", "8", "--dump-rollouts"]
    rows = train(*preflight(build_config(args)))
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["rollout/agent_turns_mean"] == 2.0 and row["rollout/agent_failed_frac"] == 0.0
        assert np.isfinite(row["train/loss"]) and np.isfinite(row["train/grad_norm"])
    dumped = [json.loads(x) for x in (tmp_path / "run" / "rollouts" / "step_000000.jsonl").read_text().splitlines()]
    assert len(dumped) == 4
    for d in dumped:  # the rubric's reward: half the number of words of the model's last answer
        assert d["reward"] >= 0.0 and float(2 * d["reward"]).is_integer(), d["reward"]
        assert "again" in d["response"]  # the environment's second user turn sits inside the response
