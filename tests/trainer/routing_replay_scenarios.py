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

from slime_rl.config.groups import AlgoConfig, BatchConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainerConfig
from tests.trainer.moe_scenarios import _worker
from tests.trainer.routing_ref import engine_routing, hf_forced_logprobs
from tests.trainer.trainer_ref import make_batch, select
from tests.trainer.trainer_scenarios import weights

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


# ---- R2 (--use-routing-replay alone): the old-log-prob forward's routing replayed in training.
# Two mini-batches of two samples (global), one sample per micro-batch, right-padded rows: every router
# call is one sample's positions in order, so the test maps calls to samples without trainer code.
# A large Adam step after the first mini-batch moves the routers far enough that their own top-2
# changes for some tokens of the second.
R2_LR = 5.0
R2_ORDER = [0, 2, 1, 3]  # one rank: global mini-batches {0, 2} and {1, 3}, as EP=2 (DP=2) forms them


def _r2_worker(rank: int, world: int, port: int, ckpt: str, ep: int, r2: bool, gbs: int = 2, tp: int = 1,
               pp: int = 1):
    """Adam with eps 1 (about SGD for these gradients: layouts' rounding differences stay small after
    the step) and a large lr; TP > 1: sequence parallel, packed rows (megatron's MoE needs both)."""
    from slime_rl.trainer.worker import TrainerWorker

    return TrainerWorker(rank, world, "127.0.0.1", port,
                         ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                        actor_num_gpus_per_node=world, expert_model_parallel_size=ep),
                         BatchConfig(micro_batch_size=1, global_batch_size=gbs),
                         OptimizerConfig(lr=R2_LR, adam_eps=1.0, clip_grad=0.0), ModelConfig(hf_checkpoint=ckpt),
                         AlgoConfig(), train_iters=10,
                         trainer=TrainerConfig(pack_sequences=tp > 1, sequence_parallel=tp > 1,
                                               use_routing_replay=r2))


def _spy(w, res: dict, key: str) -> dict:
    """Every router call (layer, phase, chosen top-2, the router's own top-2 of these weights), the
    training forward's log-probs per sample, and the HF weights after the first optimizer step."""
    import torch

    from slime_rl.trainer import steps

    state = {"phase": "old", "calls": [], "logp": {}}
    for r in w.engine_routing:
        orig = r.get_replay_topk

        def spy(scores, topk, *a, _orig=orig, _layer=r.layer, **kw):
            probs, idx = _orig(scores, topk, *a, **kw)
            own = torch.topk(scores.detach(), topk, dim=-1).indices  # softmax router: top-k of the logits
            state["calls"].append((_layer, state["phase"], idx.detach().clone(), own.clone()))
            return probs, idx

        r.get_replay_topk = spy
    objective = steps.policy_objective

    def capture(algo, logp, mb, *a, **kw):
        for row, valid, j in zip(logp.detach(), mb.valid, mb.sample_ids, strict=True):
            state["logp"][state["phase"], j] = row[: int(valid.sum())].double().clone()
        return objective(algo, logp, mb, *a, **kw)

    steps.policy_objective = capture
    step = w.optimizer_step
    state["n_steps"] = 0

    def optimizer_step():
        out = step()
        state["n_steps"] += 1
        if state["n_steps"] == 1:
            res[f"{key}/w1"] = weights(w)
        state["phase"] = f"train{state['n_steps']}"
        return out

    w.optimizer_step = optimizer_step
    state["restore"] = lambda: setattr(steps, "policy_objective", objective)
    return state


def _r2_record(rank: int, world: int, port: int, ckpt: str, ep: int, r2: bool, key: str, res: dict,
               tp: int = 1, pp: int = 1) -> None:
    w = _r2_worker(rank, world, port, ckpt, ep, r2, tp=tp, pp=pp)
    ids = R2_ORDER if w.dp_size == 1 else [2 * w.dp_rank, 2 * w.dp_rank + 1]
    shard = select(make_batch(), ids)
    state = _spy(w, res, key)
    try:
        inputs = w.step_inputs(shard)
        state["phase"] = "train0"
        res[f"{key}/metrics"] = w.train_step(shard, inputs)
    finally:
        state["restore"]()
    # calls -> samples: the old pass runs the shard's samples in order, mini-batch m its per-rank slice
    per = 2 // w.dp_size
    seen: dict = {}
    calls = {}
    for layer, phase, idx, own in state["calls"]:
        k = seen[phase, layer] = seen.get((phase, layer), -1) + 1
        pos = k if phase == "old" else int(phase[len("train"):]) * per + k
        calls[phase, layer, ids[pos]] = (idx, own)
    res[f"{key}/calls"] = calls
    res[f"{key}/logp"] = {ids[int(phase[len("train"):]) * per + j]: v for (phase, j), v in state["logp"].items()}
    res[f"{key}/old"] = {g: row for g, row in zip(ids, inputs.old, strict=True)}
    w.shutdown()


def scenario_r2_1(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    res: dict = {}
    _record_r2_fused(rank, world, port + 2, ckpts["qwen3_moe"], res)
    _r2_record(rank, world, port, ckpts["qwen3_moe"], 1, True, "r2", res)
    _r2_record(rank, world, port + 1, ckpts["qwen3_moe"], 1, False, "free", res)
    return res


def _record_r2_fused(rank: int, world: int, port: int, ckpt: str, res: dict) -> None:
    """One mini-batch per rollout (the fused path): R2 records nothing and changes nothing."""
    for key, r2 in (("fused_r2", True), ("fused_free", False)):
        batch = select(make_batch(), R2_ORDER)
        w = _r2_worker(rank, world, port, ckpt, 1, r2, gbs=4)
        state = _spy(w, res, key)
        try:
            state["phase"] = "train0"
            res[f"{key}/metrics"] = w.train_step(batch)
        finally:
            state["restore"]()
        res[f"{key}/weights"] = weights(w)
        res[f"{key}/phases"] = sorted({phase for _, phase, _, _ in state["calls"]})
        w.shutdown()
        port += 10


def scenario_r2_ep2(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    res: dict = {}
    _r2_record(rank, world, port, ckpts["qwen3_moe"], 2, True, "r2", res)
    return res


def scenario_r2_ep2tp2(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    res: dict = {}
    _r2_record(rank, world, port, ckpts["qwen3_moe"], 2, True, "r2", res, tp=2)
    return res


def scenario_r2_ep2pp2(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    res: dict = {}
    _r2_record(rank, world, port, ckpts["qwen3_moe"], 2, True, "r2", res, pp=2)
    return res


SCENARIOS.update({"r2_1": scenario_r2_1, "r2_ep2": scenario_r2_ep2, "r2_ep2tp2": scenario_r2_ep2tp2,
                  "r2_ep2pp2": scenario_r2_ep2pp2})
