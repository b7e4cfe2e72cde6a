"""Qwen2.5-VL trainer scenarios (spawned gloo ranks, run through trainer_scenarios.main).

The batch (tokens with image pads, PNG data URLs, grids) is built once by the test with the data
side's own code and saved to a file; its path comes in `ckpts["vl_batch"]`, the checkpoint in
`ckpts["qwen2_5_vl"]`. Each scenario records log-probs and the weights after one train step.
"""

from __future__ import annotations

import dataclasses

import torch

from slime_rl.config.groups import AlgoConfig


def _batch(ckpts: dict[str, str]) -> dict:
    return torch.load(ckpts["vl_batch"], weights_only=False)


def _weights(w) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in w.iter_hf_weights()}


def _run(rank: int, world: int, port: int, ckpts: dict[str, str], **kw) -> dict:
    from tests.trainer.trainer_scenarios import make_worker

    batch = _batch(ckpts)
    w = make_worker(rank, world, port, ckpts["qwen2_5_vl"], mbs=2, gbs=4, algo=AlgoConfig(), **kw)
    res = {"logp": w.compute_logprobs(batch), "before": _weights(w)}
    if kw.get("tp", 1) == 1 and kw.get("pp", 1) == 1:
        packed = w.micro
        w.micro = dataclasses.replace(packed, pack_sequences=False)  # right-padded [b, s] layout
        res["logp_padded"] = w.compute_logprobs(batch)
        w.micro = packed
    res["metrics"] = w.train_step(batch)
    res["after"] = _weights(w)
    res["synced_names"] = [n for n, _, _ in w.iter_hf_sources(skip_frozen=True)]  # what sync_weights sends
    w.shutdown()
    return res


def scenario_vl_tp1(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    return _run(rank, world, port, ckpts)


def scenario_vl_tp2_sp(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    return _run(rank, world, port, ckpts, tp=2, sequence_parallel=True)


def scenario_vl_pp2(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    return _run(rank, world, port, ckpts, pp=2)


def scenario_vl_frozen(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    return _run(rank, world, port, ckpts, freeze_vision_tower=True)


def scenario_vl_resume(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    """Two steps straight vs one step, a Megatron checkpoint (model + optimizer, vision tower
    included), a new worker that loads it, one more step."""
    from tests.trainer.trainer_scenarios import make_worker

    batch, root = _batch(ckpts), ckpts["vl_ckpt_root"]
    w = make_worker(rank, world, port, ckpts["qwen2_5_vl"], mbs=2, gbs=4)
    w.train_step(batch)
    w.save_checkpoint(root, 1, {"step": 1})
    w.train_step(batch)
    straight = _weights(w)
    w.shutdown()
    w = make_worker(rank, world, port + 1, ckpts["qwen2_5_vl"], mbs=2, gbs=4)
    loaded = w.load_latest_checkpoint(root)
    w.train_step(batch)
    res = {"straight": straight, "resumed": _weights(w), "extra": loaded}
    w.shutdown()
    return res


SCENARIOS = {"vl_resume": scenario_vl_resume, "vl_tp1": scenario_vl_tp1, "vl_tp2_sp": scenario_vl_tp2_sp,
             "vl_pp2": scenario_vl_pp2, "vl_frozen": scenario_vl_frozen}
