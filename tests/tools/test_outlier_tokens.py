"""bench/outlier_tokens.py names the tokens over the threshold from debug-dump files, with their place.

The files are written here by the run's own writers (debug_rollout_data, train_data); the planted
outliers and every expected field are set by hand."""

import torch

from bench.outlier_tokens import main
from slime_rl.data import Sample
from slime_rl.orchestration.rollout_manager import debug_rollout_data
from slime_rl.trainer.debug_data import train_data


def _sample(index, group, prompt, response, trainer, engine, mask=None, finish="stop"):
    """(the Sample the rollout dump writes, the trainer's old log-probs)"""
    sample = Sample(index=index, group_index=group, prompt="p", prompt_ids=prompt, response_ids=response,
                    rollout_logprobs=engine, loss_mask=mask or [1] * len(response), finish_reason=finish, reward=0.0)
    return sample, trainer


def _write(tmp_path, step, samples, shards):
    """The two dumps through the run's own writers: the rollout's groups, and per DP rank its samples."""
    torch.save(debug_rollout_data(step, [samples]), tmp_path / f"rollout_{step}.pt")
    for rank, shard in enumerate(shards):
        batch = {"tokens": [s.tokens for s, _ in shard], "response_lengths": [s.response_length for s, _ in shard],
                 "rollout_logprobs": [s.rollout_logprobs for s, _ in shard],
                 "loss_masks": [s.loss_mask for s, _ in shard], "advantages": [0.0] * len(shard),
                 "rewards": [0.0] * len(shard)}
        torch.save(train_data(step, rank, len(shards), batch, [old for _, old in shard], None, "fused"),
                   tmp_path / f"train_{step}_{rank}.pt")


def test_outliers_are_named_with_their_place(tmp_path):
    # step 0: rank 0 clean; rank 1 one outlier at the first response token (0.05), one masked token (0.5:
    # not trained, not counted) and one gap of exactly the threshold (not over it)
    r0a, t0a = _sample(0, 0, [5, 6, 7], [10, 11], [-1.0, -2.0], [-1.0, -2.0 + 1e-6])
    r0b, t0b = _sample(1, 0, [5, 6, 7], [12, 13, 14], [-1.0, -0.5, -0.1], [-1.05, -1.0, -0.11], mask=[1, 0, 1])
    # step 1: one outlier at the last token of a truncated sample of group 3 (0.2)
    r1, t1 = _sample(7, 3, [8, 9], [20, 21, 22, 23], [-0.1, -0.2, -0.3, -0.4], [-0.1, -0.2, -0.3, -0.6],
                     finish="length")
    a, b, c = (r0a, t0a), (r0b, t0b), (r1, t1)
    _write(tmp_path, 0, [r0a, r0b], [[a], [b]])
    _write(tmp_path, 1, [r1], [[c], []])
    out = tmp_path / "r.json"
    main(["--rollout", str(tmp_path / "rollout_{rollout_id}.pt"),
                    "--train", str(tmp_path / "train_{rollout_id}_{rank}.pt"), "--out", str(out)])
    import json

    result = json.loads(out.read_text())
    got = [(t["step"], t["rank"], t["sample"], t["group"], t["position"], t["response_length"], t["prompt_length"],
            t["absolute_position"], t["finish_reason"], t["token"]) for t in result["tokens"]]
    assert got == [(0, 1, 1, 0, 0, 3, 3, 3, "stop", 12), (1, 0, 7, 3, 3, 4, 2, 5, "length", 23)]
    assert [round(t["gap"], 6) for t in result["tokens"]] == [0.05, 0.2]
    s = result["summary"]
    assert (s["steps"], s["steps_with_outliers"], s["outlier_tokens"]) == (2, 2, 2)
    assert s["trained_tokens"] == 2 + 2 + 4  # the masked token is not trained
    assert s["by_position"] == {"first": 1, "last": 1}
    assert [round(x["largest_gap"], 6) for x in result["steps"]] == [0.05, 0.2]
