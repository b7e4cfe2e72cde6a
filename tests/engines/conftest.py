"""Fixtures for the engine tests: an in-process embedded server on the tiny Qwen2 checkpoint, and a
float64 copy of the same checkpoint that computes reference log-probs independently of the engine."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch
from engine_testlib import start_server

from slime_rl.engines.embedded.server import EmbeddedServer


@pytest.fixture(scope="session")
def server(tiny_qwen2) -> Iterator[EmbeddedServer]:
    s = start_server(tiny_qwen2, random_seed=1234, max_running_requests=32)
    yield s
    s.shutdown()


@pytest.fixture()
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def model64(tiny_qwen2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float64).eval()
