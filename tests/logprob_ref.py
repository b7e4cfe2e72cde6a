"""The independent reference for engine log-probs, shared by the engine and rollout tests."""

from __future__ import annotations

import torch


def reference_logprobs(model64, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    """float64 log_softmax(logits / T) of each output token given everything before it: one unpadded
    forward over prompt + output, none of the engine's code paths (no KV cache, no batching, no
    continuation)."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model64(input_ids=ids).logits[0].double()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    rows = lp[len(prompt) - 1: len(prompt) + len(output) - 1]
    return rows.gather(1, torch.tensor(output)[:, None]).squeeze(1)
