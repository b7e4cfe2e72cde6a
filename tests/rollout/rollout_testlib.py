"""Helpers shared by the rollout tests (a uniquely named module: `conftest` names are ambiguous)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from slime_rl.data import PromptRow
from slime_rl.engines.client import AsyncEngineClient
from slime_rl.engines.embedded.server import EmbeddedServer, ServerConfig
from tests.logprob_ref import reference_logprobs  # noqa: F401 (re-exported for the tests)


def start_server(model_path: Path, **kw: Any) -> EmbeddedServer:
    """port=0: the OS picks a free loopback port (no race with other tests). Requests' sampling_seed
    is honoured (enable_deterministic_inference, as SGLang needs it) unless the caller says otherwise."""
    kw.setdefault("enable_deterministic_inference", True)
    return EmbeddedServer(ServerConfig(model_path=str(model_path), host="127.0.0.1", port=0, **kw)).start()


def with_clients(urls: Sequence[str], body: Callable[[list[AsyncEngineClient]], Awaitable[Any]]) -> Any:
    """Run `body(clients)` on a fresh event loop; the clients are closed afterwards."""
    async def main() -> Any:
        clients = [AsyncEngineClient(u, timeout=120) for u in urls]
        try:
            return await body(clients)
        finally:
            for c in clients:
                await c.aclose()

    return asyncio.run(main())


def prompt_of(n: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of n ordinary ids in [0, 61) (61-63 are the tiny tokenizer's specials)."""
    return [(7 * i + 11 * salt + 5) % 61 for i in range(n)]


def row(salt: int, label: Any = None, n: int = 6) -> PromptRow:
    return PromptRow(prompt=f"p{salt}", prompt_ids=prompt_of(n, salt), label=label, metadata={"salt": salt})


def feeder(rows: Sequence[PromptRow]) -> tuple[Callable[[int], list[PromptRow]], list[int]]:
    """`next_rows(k)` over `rows` (then empty), and the list of batch sizes it was asked for."""
    queue, asked = list(rows), []

    def next_rows(k: int) -> list[PromptRow]:
        asked.append(k)
        out = queue[:k]
        del queue[:k]
        return out

    return next_rows, asked


def float64_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


def slow_or_fast(max_slow: int):
    """A generate function giving 'slow' samples a long response (ignore_eos), others the usual budget:
    the slow groups are still running when the fast ones fill the batch."""
    from slime_rl.rollout.custom import generate_default

    async def generate(sample, sampling_params, pool):
        if sample.label == "slow":
            sampling_params = {**sampling_params, "max_new_tokens": max_slow, "ignore_eos": True}
        return await generate_default(sample, sampling_params, pool)
    return generate
