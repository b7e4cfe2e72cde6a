"""Helpers shared by the engine tests (a uniquely named module: `conftest` names are ambiguous)."""

from __future__ import annotations

from pathlib import Path

import torch

from slime_rl.engines.embedded.server import EmbeddedServer, ServerConfig


def start_server(model_path: Path, **kw) -> EmbeddedServer:
    """port=0: the OS picks a free loopback port (no race with other tests)."""
    return EmbeddedServer(ServerConfig(model_path=str(model_path), host="127.0.0.1", port=0, **kw)).start()


def reference_logprobs(model64, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """float64 log_softmax(logits / T) of each output token given everything before it: one unpadded
    forward over prompt + output, no KV cache, no batching (none of the engine's code paths)."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model64(input_ids=ids).logits[0].double()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    rows = lp[len(prompt) - 1: len(prompt) + len(output) - 1]
    return rows.gather(1, torch.tensor(output)[:, None]).squeeze(1)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of n ordinary ids in [0, 61) (61-63 are the tiny tokenizer's specials)."""
    return [(7 * i + 11 * salt + 5) % 61 for i in range(n)]
