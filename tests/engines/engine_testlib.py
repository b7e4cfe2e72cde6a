"""Helpers shared by the engine tests (a uniquely named module: `conftest` names are ambiguous)."""

from __future__ import annotations

from pathlib import Path

from slime_rl.engines.embedded.server import EmbeddedServer, ServerConfig
from tests.logprob_ref import reference_logprobs  # noqa: F401 (re-exported for the tests)


def start_server(model_path: Path, **kw) -> EmbeddedServer:
    """port=0: the OS picks a free loopback port (no race with other tests). Requests' sampling_seed
    is honoured (enable_deterministic_inference, as SGLang needs it) unless the caller says otherwise."""
    kw.setdefault("enable_deterministic_inference", True)
    return EmbeddedServer(ServerConfig(model_path=str(model_path), host="127.0.0.1", port=0, **kw)).start()


def prompt_of(n: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of n ordinary ids in [0, 61) (61-63 are the tiny tokenizer's specials)."""
    return [(7 * i + 11 * salt + 5) % 61 for i in range(n)]
