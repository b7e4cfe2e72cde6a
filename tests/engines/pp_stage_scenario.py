"""PP=2 weight sync into two built-in engines, each stage's source in its own thread (as two trainer
ranks would be), with the engines reached in crossed orders: stage 0 reaches engine A first and B one
second later, stage 1 the other way round. An engine serves one weight-update call at a time for the
whole call (SGLang's lock; engines/embedded/session.py), and joining a gloo group waits for every
member: so stages that connect at once leave A inside stage 0's group waiting for B and B inside
stage 1's waiting for A (with NCCL, whose broadcast needs every rank, sending at once does too).
`serialize=True` runs each stage's turn through weight_sync.broadcast.in_stage_order (what the
trainer does), `False` lets them go at once (the code before #17). Used in-process by
test_pp_stage_order.py, and as a script (`python -m tests.engines.pp_stage_scenario MODEL
concurrent`) for the run expected to hang.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from typing import Any

import torch

from slime_rl.config import WeightSyncConfig
from slime_rl.engines.embedded.server import EmbeddedServer, ServerConfig
from slime_rl.weight_sync.broadcast import EngineTarget, WeightBroadcaster, in_stage_order

DELAY_S = 1.0


class Late:
    """An engine client whose group joins and updates leave `delay` seconds late."""

    def __init__(self, client: Any, delay: float) -> None:
        self._client, self._delay = client, delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def init_weights_update_group(self, *a: Any, **kw: Any) -> Any:
        time.sleep(self._delay)
        return self._client.init_weights_update_group(*a, **kw)

    def update_weights_from_distributed(self, *a: Any, **kw: Any) -> Any:
        time.sleep(self._delay)
        return self._client.update_weights_from_distributed(*a, **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stage_weights(params: dict[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
    """Stage 0: layer 0; stage 1: everything else (embedding, layer 1, norm), new random values."""
    gen = torch.Generator().manual_seed(5)
    names = sorted(n for n in params if n != "lm_head.weight")  # tied to the embedding
    new = {n: 0.05 * torch.randn(params[n].shape, generator=gen) for n in names}
    first = [(n, new[n]) for n in names if ".layers.0." in n]
    return [first, [(n, new[n]) for n in names if ".layers.0." not in n]]


def run(engines: list[EmbeddedServer], serialize: bool) -> list[list[tuple[str, torch.Tensor]]]:
    """Connect both stages and sync once; returns what each stage sent."""
    weights = stage_weights(engines[0].weights.params)
    targets = [EngineTarget(e.url, rank_offset=1 + i) for i, e in enumerate(engines)]
    stages = [WeightBroadcaster(targets, WeightSyncConfig(1 << 20), True, "127.0.0.1", _free_port(), 3, "gloo",
                                group_name=f"wu_pp{s}") for s in range(2)]
    # stage 0 reaches engine B late, stage 1 engine A: the crossed orders
    stages[0]._clients[1] = Late(stages[0]._clients[1], DELAY_S)
    stages[1]._clients[0] = Late(stages[1]._clients[0], DELAY_S)
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def turn(s: int, fn):
        return in_stage_order(s, 2, barrier.wait, fn) if serialize else fn()

    def stage(s: int) -> None:
        try:
            turn(s, stages[s].connect)
            if s == 0:  # the trainer's rank 0 holds the session open around every stage's sync
                stages[0].begin_update()
            barrier.wait()
            turn(s, lambda: stages[s].sync(iter(weights[s]), version="pp-1", own_session=False))
            barrier.wait()
            if s == 0:
                stages[0].end_update()
        except BaseException as e:  # reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=stage, args=(s,), daemon=True) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for b in stages:
        b.destroy()
    return weights


if __name__ == "__main__":
    model, mode = sys.argv[1], sys.argv[2]
    servers = [EmbeddedServer(ServerConfig(model_path=model, host="127.0.0.1", port=0)).start() for _ in range(2)]
    print("engines up", flush=True)
    run(servers, serialize=mode == "serialized")
    print("synced", flush=True)
    for srv in servers:
        srv.shutdown()
