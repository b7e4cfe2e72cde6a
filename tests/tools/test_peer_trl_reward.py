"""bench/peer_trl.py's reward function for TRL: reasoning-gym's verifier per completion, and per generation
batch the mean reward and the mean completion length from the completion ids TRL passes (TRL 1.16's
GRPOTrainer._calculate_rewards calls reward functions with completion_ids=...)."""

import json

import pytest

pytest.importorskip("reasoning_gym")

from bench.peer_trl import METADATA_KEY, trl_reward  # noqa: E402
from tools.make_reasoning_gym_data import make_rows  # noqa: E402


def test_scores_and_lengths_per_batch_by_hand():
    rows = make_rows("chain_sum", 2, 0)
    assert rows[0]["label"] != rows[1]["label"]  # a wrong answer below is wrong
    rewards, lengths = [], []
    fn = trl_reward(rewards, lengths)
    labels = [r["label"] for r in rows]
    meta = [json.dumps(r[METADATA_KEY]) for r in rows]
    # conversational completions (a list of messages) and plain text alike; the second answer is wrong
    scores = fn([[{"role": "assistant", "content": labels[0]}], labels[0]], labels, meta,
                completion_ids=[[1, 2, 3], [4, 5, 6, 7, 8]])
    assert scores == [1.0, 0.0]
    fn([labels[0], labels[1]], labels, meta, completion_ids=[[1], [2, 3]])
    assert rewards == [0.5, 1.0] and lengths == [4.0, 1.5]
    fn([labels[1]], labels[1:], meta[1:])  # an older TRL without completion_ids: no length, no error
    assert rewards == [0.5, 1.0, 1.0] and lengths == [4.0, 1.5]
