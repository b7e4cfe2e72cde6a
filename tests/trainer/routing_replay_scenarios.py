"""Rollout routing replay scenarios (trainer/routing_replay.py), run like trainer_scenarios.py
(`python -m tests.trainer.trainer_scenarios NAME ...` finds them here).

The fixed batch carries an "engine" routing that differs from the model's own on known pairs
(routing_ref.engine_routing) and, as its rollout log-probs, HF's float64 log-probs under that routing
(routing_ref.hf_forced_logprobs): the step-0 gap of an engine whose routing flipped. Each layout
records its DP shard's log-probs (padded and packed) and one train step's metrics, with
--use-rollout-routing-replay and (one rank) without.
"""

from __future__ import annotations

import dataclasses

from slime_rl.config.groups import AlgoConfig
from tests.trainer.moe_scenarios import _worker
from tests.trainer.routing_ref import engine_routing, hf_forced_logprobs
from tests.trainer.trainer_ref import make_batch, select

RR_LAYOUTS = {"rr1": (1, 1, 1), "rr_ep2": (1, 1, 2), "rr_ep2tp2": (2, 1, 2), "rr_ep2pp2": (1, 2, 2)}


def routed_batch(ckpt: str) -> dict:
    batch = make_batch()
    routing, _ = engine_routing(ckpt, batch)
    batch["rollout_routed_experts"] = routing
    batch["rollout_logprobs"] = [t.tolist() for t in hf_forced_logprobs(ckpt, batch, routing)]
    return batch


def _record(rank: int, world: int, port: int, ckpt: str, name: str, key: str, replay: bool, res: dict) -> None:
    tp, pp, ep = RR_LAYOUTS[name]
    batch = routed_batch(ckpt)
    w = _worker(rank, world, port, ckpt, tp, pp, ep, 0.0, use_rollout_routing_replay=replay,
                sequence_parallel=tp > 1)
    n = len(batch["tokens"]) // w.dp_size
    ids = list(range(w.dp_rank * n, (w.dp_rank + 1) * n))
    shard = select(batch, ids)
    res[f"{key}/ids"] = ids
    for layout in ("packed",) if tp > 1 else ("padded", "packed"):
        w.micro = dataclasses.replace(w.micro, pack_sequences=layout == "packed")
        res[f"{key}/{layout}/logp"] = w.compute_logprobs(shard)
    w.algo = AlgoConfig()
    res[f"{key}/metrics"] = w.train_step(shard)
    w.shutdown()


def scenario_rr1(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    res: dict = {}
    _record(rank, world, port, ckpts["qwen3_moe"], "rr1", "replay", True, res)
    _record(rank, world, port + 1, ckpts["qwen3_moe"], "rr1", "free", False, res)
    return res


def _layout(name: str):
    def scenario(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
        res: dict = {}
        _record(rank, world, port, ckpts["qwen3_moe"], name, "replay", True, res)
        return res

    return scenario


SCENARIOS = {"rr1": scenario_rr1, "rr_ep2": _layout("rr_ep2"), "rr_ep2tp2": _layout("rr_ep2tp2"),
             "rr_ep2pp2": _layout("rr_ep2pp2")}
