"""--save-debug-train-data: what a data-parallel rank trained on in one step, for its file
(observability.debug_data.save_debug_data writes it).

One rank per DP rank writes: TP rank 0, CP rank 0, on the last pipeline stage (the stage that
computes the log-probs and the loss; the others hold the same batch and, but for PP, the same
log-probs). `log_probs` are the trainer's old-policy log-probs of the response tokens, the ones
train/rollout_logprob_abs_diff compares with the engine's: the separate forward-only pass's
(objective.step_sums), or on the fused one-optimizer-step path the training forward's own, detached
(objective.policy_objective), which steps.policy_loss_step(keep_logp=True) hands back per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# how `log_probs` were computed: the training forward's own (one optimizer step per rollout), or a
# forward-only pass before the mini-batches
FUSED, SEPARATE = "training forward (fused)", "separate forward pass"


@dataclass(frozen=True)
class TrainDataDump:
    """Where a step's train data goes: the formatted --save-debug-train-data path of this DP rank."""

    path: str
    rollout_id: int


def writes_train_data(tp_rank: int, cp_rank: int, pp_rank: int, pp_size: int) -> bool:
    """Whether this rank writes its DP rank's file."""
    return tp_rank == 0 and cp_rank == 0 and pp_rank == pp_size - 1


def train_data(
    rollout_id: int,
    dp_rank: int,
    dp_size: int,
    batch: dict[str, Any],
    old_logprobs: list[list[float]],
    advantages: list[list[float]] | None,
    source: str,
) -> dict[str, Any]:
    """The file's dict: {"rollout_id", "rank" (the DP rank), "dp_size", "log_probs_from" (FUSED or
    SEPARATE), "samples"}, one dict per sample of this rank's batch, in its order:
      tokens (prompt + response ids), response_ids, response_length, log_probs (the trainer's old
      policy, one per response token), rollout_log_probs (the engine's), loss_mask, advantages (one per
      response token, as the loss used them: a scalar estimator's value repeated, or `advantages`,
      the token-level ones), reward (the shaped reward the advantages came from).
    `old_logprobs` / `advantages`: per-sample lists indexed like the batch."""
    samples = []
    for i, tokens in enumerate(batch["tokens"]):
        n = int(batch["response_lengths"][i])
        tokens = [int(t) for t in tokens]
        old = [float(x) for x in old_logprobs[i]]
        if len(old) != n:
            raise ValueError(f"sample {i}: {len(old)} old log-probs for {n} response tokens")
        adv = [float(x) for x in advantages[i]] if advantages is not None else [float(batch["advantages"][i])] * n
        samples.append(
            {
                "tokens": tokens,
                "response_ids": tokens[len(tokens) - n :],
                "response_length": n,
                "log_probs": old,
                "rollout_log_probs": [float(x) for x in batch["rollout_logprobs"][i]],
                "loss_mask": list(batch["loss_masks"][i]),
                "advantages": adv,
                "reward": float(batch["rewards"][i]),
            }
        )
    return {"rollout_id": rollout_id, "rank": dp_rank, "dp_size": dp_size, "log_probs_from": source, "samples": samples}
