"""An agent harness that knows only the `openai` client (tests/plugins/openai_agent.py) trains through the
whole loop on CPU: Ray, a Megatron rank on gloo, the built-in engine; each sample is one two-turn
trajectory recorded token for token through the rollout's OpenAI endpoint (the exactness itself is
checked against the engine and the template in tests/rollout/test_agent.py)."""

from __future__ import annotations

import json
from pathlib import Path

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
    words of the last answer), two steps trained. 1 prompt x 2 samples a step: each turn starts verifiers'
    chat program, ~1 s on 2 cores."""
    args = argv(tiny_qwen2, digit_data, tmp_path / "run", steps=2) + [
        "--tensor-model-parallel-size", "1", "--actor-num-gpus-per-node", "1", "--rollout-max-response-len", "64",
        "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--global-batch-size", "2", "--micro-batch-size",
        "2", "--agent-env", f'verifiers:{TASKSET_FILE}:{{"agent":{{"harness":{{"id":"null"}}}}}}',
        "--agent-turn-max-tokens", "8", "--dump-rollouts"]
    rows = train(*preflight(build_config(args)))
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["rollout/agent_turns_mean"] == 2.0 and row["rollout/agent_failed_frac"] == 0.0
        assert np.isfinite(row["train/loss"]) and np.isfinite(row["train/grad_norm"])
    dumped = [json.loads(x) for x in (tmp_path / "run" / "rollouts" / "step_000000.jsonl").read_text().splitlines()]
    assert len(dumped) == 2
    for d in dumped:  # the rubric's reward: half the number of words of the model's last answer
        assert d["reward"] >= 0.0 and float(2 * d["reward"]).is_integer(), d["reward"]
        assert "again" in d["response"]  # the environment's second user turn sits inside the response


def train_episodes(spec: str, model, data, tmp_path, response_len: int) -> list[dict]:
    """Two steps of 1 prompt x 2 episodes of the --agent-env `spec` (8 tokens a turn), the rollouts saved under
    tmp_path/debug: the metrics rows."""
    args = argv(model, data, tmp_path / "run", steps=2) + [
        "--tensor-model-parallel-size", "1", "--actor-num-gpus-per-node", "1", "--rollout-max-response-len",
        str(response_len), "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--global-batch-size", "2",
        "--micro-batch-size", "2", "--agent-env", spec, "--agent-turn-max-tokens", "8", "--save-debug-rollout-data",
        str(tmp_path / "debug" / "rollout_{rollout_id}.pt")]
    return train(*preflight(build_config(args)))


def mask_runs(sample: dict) -> list[tuple[int, list[int]]]:
    """(loss mask, ids) of each run of a debug-dumped sample's response: the model's turns (1) and the
    environment's (0), in order."""
    runs: list[tuple[int, list[int]]] = []
    for i, m in zip(sample["response_ids"], sample["loss_mask"], strict=True):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(i)
        else:
            runs.append((m, [i]))
    return runs


@pytest.fixture(scope="module")
def textarena_words(ray_session):
    """nltk's `words` corpus and tagger for TextArena's word games, made here (tests/nltk_words.py) in the session's
    nltk data folder, which the session's Ray workers search first."""
    import nltk

    from tests import nltk_words

    root = nltk_words.build(nltk_words.FOLDER)
    if str(root) not in nltk.data.path:  # this process imported nltk before the session set NLTK_DATA
        nltk.data.path.insert(0, str(root))
    return root


@pytest.mark.slow
def test_verifiers_own_textarena_taskset_trains_two_steps(textarena_words, tiny_qwen2, digit_data, tmp_path):
    """--agent-env verifiers:textarena: the taskset verifiers 0.4.0 ships (verifiers.v1.tasksets.textarena: its
    `TextArenaEnv` steps TextArena's own Hangman-v0 as the user; verifiers' null harness plays), unchanged, two
    steps of 1 prompt x 2 samples trained (each turn starts verifiers' chat program, ~1 s on 2 cores). Each
    sample is replayed here by TextArena from its task's seed with the model's replies as the engine sampled
    them (the response's loss-masked runs, decoded): the prompt is the seeded game's board, the game's feedback
    after each reply is the environment's text that follows it in the trained tokens, the game ends at the last
    reply, and its reward is the sample's."""
    import random

    import textarena as ta
    import torch
    from transformers import AutoTokenizer
    from verifiers.v1.tasksets.textarena.taskset import _latest_feedback

    spec = 'verifiers:textarena:{"taskset":{"game":"Hangman-v0"},"player":{"harness":{"id":"null"}}}'
    rows = train_episodes(spec, tiny_qwen2, digit_data, tmp_path, response_len=400)
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["rollout/agent_failed_frac"] == 0.0 and row["rollout/agent_turns_mean"] >= 1.0
        assert np.isfinite(row["train/loss"]) and np.isfinite(row["train/grad_norm"])
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    for step in (0, 1):
        samples = torch.load(tmp_path / "debug" / f"rollout_{step}.pt", weights_only=False)["samples"]
        assert len(samples) == 2
        for s in samples:
            meta = s["metadata"]
            runs = mask_runs(s)
            replies = [tok.decode(ids, skip_special_tokens=True) for m, ids in runs if m]
            between = [tok.decode(ids) for m, ids in runs if not m]
            assert runs[0][0] == 1 and len(replies) == meta["agent_turns"] and len(between) >= len(replies) - 1
            random.seed(int(meta["verifiers_task"]["name"].rsplit("#", 1)[1]))  # the taskset's seed of the task
            game = ta.make(env_id="Hangman-v0")
            game.reset(num_players=1)
            board = str(game.get_observation()[1])  # the task's prompt: the seeded word's board
            assert tok.decode(tok.encode(board)) in tok.decode(s["prompt_ids"])
            for k, reply in enumerate(replies):
                game.step(reply)
                if k < len(replies) - 1:
                    assert not game.state.done, (k, replies)
                    feedback = _latest_feedback(str(game.get_observation()[1]))
                    assert tok.decode(tok.encode(feedback)) in between[k], (feedback, between[k])
            if game.state.done:
                expected = float((game.state.rewards or {}).get(0, 0.0))
            else:  # the response's budget ended the episode first
                assert s["finish_reason"] == "length"
                expected = 0.0
            assert s["reward"] == meta["verifiers_rewards"]["game_reward"] == expected, (s["reward"], expected)


@pytest.fixture(scope="module")
def openenv_echo(tmp_path_factory):
    """OpenEnv's template environment (`openenv init`'s echo environment), served by OpenEnv's own create_app in
    a process of its own (tests/rollout/openenv_echo_server.py): its URL."""
    import os
    import shutil
    import socket
    import subprocess
    import sys

    pytest.importorskip("openenv", reason="openenv is not installed (the agent extra)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = shutil.which("uv")  # without uv on PATH, `openenv init` does not lock the template's own dependencies
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not uv or Path(p) != Path(uv).parent)
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "rollout" / "openenv_echo_server.py"),
                             str(tmp_path_factory.mktemp("openenv")), str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PATH": path})
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("ready "):
            break
    else:
        raise AssertionError("the OpenEnv server did not start:\n" + "".join(lines[-40:]))
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.slow
def test_verifiers_openenv_taskset_trains_two_steps(openenv_echo, ray_session, tiny_qwen2, digit_data, tmp_path):
    """--agent-env verifiers:openenv: verifiers' own OpenEnv taskset (verifiers.v1.tasksets.openenv, unchanged)
    playing OpenEnv's template environment through OpenEnv's client, two steps of 1 prompt x 2 samples trained.
    The environment echoes each action (the model's reply, stripped, as the `message` of the action schema's one
    required field) and rewards it 0.1 per character; it is never done, so an episode ends with its response
    budget. Checked from the trained tokens of every sample: each reply (a loss-masked run, decoded) that an
    environment turn follows came back in it (`original_message`, `message_length`; as the tiny tokenizer keeps
    the JSON), and the reward is 0.1 x the characters of those replies. verifiers parses a reply as JSON first
    (its `parse_action`): a reply that is a bare number makes an action the schema refuses, and OpenEnv's
    VALIDATION_ERROR fails that episode alone (counted, its loss mask 0): such samples are checked for that."""
    import torch
    from transformers import AutoTokenizer

    spec = 'verifiers:openenv:{"taskset":{"base_url":"URL"},"player":{"harness":{"id":"null"}}}'.replace(
        "URL", openenv_echo)
    rows = train_episodes(spec, tiny_qwen2, digit_data, tmp_path, response_len=900)
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert np.isfinite(row["train/loss"]) and np.isfinite(row["train/grad_norm"])
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    played = 0

    def kept(text: str) -> str:  # as the tiny tokenizer keeps text (its alphabet has no braces or quotes)
        return tok.decode(tok.encode(text))

    for step in (0, 1):
        samples = torch.load(tmp_path / "debug" / f"rollout_{step}.pt", weights_only=False)["samples"]
        failed = [s for s in samples if s["finish_reason"] == "failed"]
        assert len(failed) == round(rows[step]["rollout/agent_failed_frac"] * len(samples))
        for s in failed:
            assert "VALIDATION_ERROR" in s["metadata"]["agent_error"] and not any(s["loss_mask"]), s["metadata"]
        for s in samples:
            if s["finish_reason"] == "failed":
                continue
            played += 1
            runs = mask_runs(s)
            replies = [tok.decode(ids, skip_special_tokens=True).strip() for m, ids in runs if m]
            between = [tok.decode(ids) for m, ids in runs if not m]
            assert runs[0][0] == 1 and len(replies) == s["metadata"]["agent_turns"] >= 2
            stepped = replies[:len(between)]  # verifiers speaks again only after stepping the reply
            for k, reply in enumerate(stepped[:-1]):  # (the last environment turn may be cut by the budget)
                assert kept(f'"original_message": {json.dumps(reply)}') in between[k], (reply, between[k])
                assert kept(f'"message_length": {len(reply)}') in between[k], (reply, between[k])
            # a last reply that no environment turn follows was stepped too when the budget ended only after it
            expected = {round(0.1 * sum(len(r) for r in replies[:n]), 9) for n in (len(stepped), len(replies))}
            assert round(s["reward"], 9) in expected, (s["reward"], expected, replies)
            assert s["metadata"]["verifiers_rewards"]["openenv_reward"] == s["reward"]
    assert played >= 1  # (each episode fails alone, rarely: 1 of 8 in the runs measured)
