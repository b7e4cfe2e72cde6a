"""Scenarios for issue 5 (algorithm flags in the trainer), run like trainer_scenarios.py
(`python -m tests.trainer.trainer_scenarios algo1|algo2 ...` finds them here).

One worker per process serves every case of algo_ref.CASES (swapping `w.algo`): first each case's
gradient of one mini-batch at fixed weights (old log-probs perturbed by OLD_DELTA where the case
says so, so clipping is active), then one real train_step per case, each from the initial weights
(restored in between: a step's metrics depend only on the weights it starts from).
World 1: TP=1, DP=1, 4 micro-batches; world 2: TP=1, DP=2, rank r holds samples {2r, 2r+1}.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from slime_rl.config.groups import AlgoConfig
from tests.trainer.algo_ref import CASES, OLD_DELTA, TIS_DELTA, ref_norm_scale
from tests.trainer.trainer_ref import make_batch, select
from tests.trainer.trainer_scenarios import hf_grads, make_worker


def _shift(rows: list[list[float]], deltas: tuple, ids: list[int]) -> list[list[float]]:
    return [[x + d for x, d in zip(row, deltas[i], strict=True)] for row, i in zip(rows, ids, strict=True)]


def _case_batch(shard: dict, old: list[list[float]], ids: list[int]) -> dict:
    """The shard with rollout log-probs = old + TIS_DELTA (so TIS weights are known exactly)."""
    return {**shard, "rollout_logprobs": _shift(old, TIS_DELTA, ids)}


def scenario_algo(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    w = make_worker(rank, world, port, ckpts["qwen2"], mbs=1, gbs=4, algo=AlgoConfig(kl_coef=0.1))
    ids = [0, 1, 2, 3] if world == 1 else [2 * w.dp_rank, 2 * w.dp_rank + 1]
    shard = select(make_batch(), ids)
    res: dict = {"ids": ids, "dp_rank": w.dp_rank, "dp_size": w.dp_size}
    # the frozen reference differs from the policy in its final norm (algo_ref.reference_model)
    norm = next(n for n in w._ref if n.endswith("final_layernorm.weight"))
    w._ref[norm] = w._ref[norm] * ref_norm_scale(w._ref[norm].numel()).to(w._ref[norm].dtype)
    params = dict(w.gpt.named_parameters())
    initial = {n: p.detach().clone() for n, p in params.items()}
    t0 = time.perf_counter()
    batches = {}
    for name, (kw, mode, perturb) in CASES.items():
        w.algo, w.loss_agg_mode = AlgoConfig(**kw), mode
        inputs = w.step_inputs(shard)
        old = _shift(inputs.old, OLD_DELTA, ids) if perturb else inputs.old
        batch = batches[name] = _case_batch(shard, inputs.old, ids)
        res[f"{name}/old"], res[f"{name}/rollout"] = old, batch["rollout_logprobs"]
        res[f"{name}/advantages"] = inputs.advantages
        res[f"{name}/stats"] = w.forward_backward(batch, old, inputs.ref, inputs.advantages)
        res[f"{name}/grad"] = hf_grads(w)
    res["time/grads"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for name, (kw, mode, _) in CASES.items():
        w.algo, w.loss_agg_mode = AlgoConfig(**kw), mode
        res[f"{name}/metrics"] = w.train_step(batches[name])
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(initial[n])
    res["time/train_steps"] = time.perf_counter() - t0
    w.shutdown()
    return {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in res.items()}


def scenario_entropy_tp2(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    """vocab_parallel_entropy on a vocab split over 2 gloo ranks (no megatron): value and gradient.
    Vocab 9 padded to 10 (the last id of rank 1 is padding); one row of huge logits."""
    import torch.distributed as dist

    from slime_rl.trainer.logprobs import vocab_parallel_entropy

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    logits, weights = entropy_inputs()
    local = logits[..., rank * 5 : (rank + 1) * 5].clone().requires_grad_(True)
    h = vocab_parallel_entropy(local, temperature=0.7, vocab_size=9, tp_group=dist.group.WORLD)
    (h * weights).sum().backward()
    with torch.no_grad():
        h_nograd = vocab_parallel_entropy(local, temperature=0.7, vocab_size=9, tp_group=dist.group.WORLD)
    dist.destroy_process_group()
    return {"rank": rank, "entropy": h.detach(), "entropy_nograd": h_nograd, "grad": local.grad}


def entropy_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, 10, generator=g) * 2
    logits[2, 0] *= 40  # near one-hot: exercises the max shift
    return logits, torch.randn(3, 4, generator=g)


def scenario_ref_update(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    """--ref-update-interval 2 with a KL loss: four rollouts on the same batch; each records the
    reference and old log-probs its step starts from."""
    w = make_worker(rank, world, port, ckpts["qwen2"], mbs=2, gbs=4,
                    algo=AlgoConfig(use_kl_loss=True, kl_loss_coef=0.1, ref_update_interval=2))
    batch = make_batch()
    out: dict = {"old": [], "ref": []}
    for _ in range(4):
        inputs = w.step_inputs(batch)
        out["old"].append(inputs.old)
        out["ref"].append(inputs.ref)
        w.train_step(batch, inputs)
    w.shutdown()
    return out


ROLLOUT_SHIFT = 0.1  # the engine's log-probs in scenario_rollout_logprobs: the trainer's + this, every token


def scenario_rollout_logprobs(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    """One step from the same weights on a batch whose rollout log-probs are the trainer's own + ROLLOUT_SHIFT,
    with and without --use-rollout-logprobs (one mini-batch: without the flag, the fused on-policy path)."""
    w = make_worker(rank, world, port, ckpts["qwen2"], mbs=2, gbs=4)
    batch = make_batch()
    own = w.compute_logprobs(batch)
    batch = {**batch, "rollout_logprobs": [[x + ROLLOUT_SHIFT for x in row] for row in own]}
    params = dict(w.gpt.named_parameters())
    initial = {n: p.detach().clone() for n, p in params.items()}
    out: dict = {}
    for name, algo in (("engine_old", AlgoConfig(use_rollout_logprobs=True)), ("own_old", AlgoConfig())):
        w.algo = algo
        out[name] = w.train_step(batch)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(initial[n])
    w.shutdown()
    return out


SCENARIOS = {"algo1": scenario_algo, "algo2": scenario_algo, "entropy_tp2": scenario_entropy_tp2,
             "ref_update": scenario_ref_update, "rollout_logprobs": scenario_rollout_logprobs}
