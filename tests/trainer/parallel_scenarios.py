"""Scenarios for issue 3 (packing, token budgets, loss aggregation, PP, sequence parallel), run like
trainer_scenarios.py (`python -m tests.trainer.trainer_scenarios NAME ...` finds them here).

World-2 checks share one process pair ("par2") because each process pays ~10 s of megatron import.
"""

from __future__ import annotations

import dataclasses
import time

from slime_rl.config.groups import AlgoConfig
from tests.trainer.trainer_ref import make_batch, select
from tests.trainer.trainer_scenarios import hf_grads, make_worker, weights

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
NORM_MAX_LEN = 8  # the constant horizon H of seq-mean-token-sum-norm in these tests


def _layouts(micro) -> dict:
    """Ways to split the 4-sample batch (lengths 7, 12, 5, 9) into micro-batches."""
    r = dataclasses.replace
    return {
        "padded4": r(micro, pack_sequences=False, micro_batch_size=4),  # 1 micro-batch
        "packed4": r(micro, micro_batch_size=4),
        "packed2": r(micro, micro_batch_size=2),
        "packed1": r(micro, micro_batch_size=1),  # 4 micro-batches
        "budget14": r(micro, use_dynamic_batch_size=True, max_tokens_per_gpu=14),  # {12}, {9, 5}, {7}
        "budget20": r(micro, use_dynamic_batch_size=True, max_tokens_per_gpu=20),  # {12, 7}, {9, 5}
    }


def scenario_agg(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    """TP=1: packed vs alone log-probs; every loss_agg_mode under every micro-batching."""
    batch, res = make_batch(), {}
    w = make_worker(rank, world, port, ckpts["qwen2"], mbs=4, pack_sequences=False)
    res["logp/padded4"] = w.compute_logprobs(batch)
    w.micro = dataclasses.replace(w.micro, pack_sequences=True)
    res["logp/packed4"] = w.compute_logprobs(batch)  # one THD row holding all 4 samples
    res["logp/alone"] = [w.compute_logprobs(select(batch, [i]))[0] for i in range(4)]
    old = res["logp/packed4"]
    base = w.micro
    for mode in MODES:
        w.loss_agg_mode, w.loss_agg_max_len = mode, NORM_MAX_LEN
        for name, micro in _layouts(base).items():
            w.micro = micro
            res[f"{mode}/{name}/n_mb"] = len(micro.groups(batch, list(range(4))))
            res[f"{mode}/{name}/stats"] = w.forward_backward(batch, old)
            res[f"{mode}/{name}/grad"] = hf_grads(w)
    w.shutdown()
    return res


def _sp(rank: int, world: int, port: int, ckpts: dict[str, str], res: dict) -> None:
    batch = make_batch()
    w = make_worker(rank, world, port, ckpts["qwen2"], tp=2, algo=AlgoConfig(temperature=0.7),
                    sequence_parallel=True, recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=1)
    res["sp/flags"] = (w.gpt.config.sequence_parallel, w.gpt.config.recompute_granularity)
    res["sp/logp"] = w.compute_logprobs(batch)
    w.algo = AlgoConfig()
    res["sp/stats"] = w.forward_backward(batch, w.compute_logprobs(batch))
    res["sp/grad"] = hf_grads(w)
    res["sp/metrics"] = w.train_step(batch)
    w.shutdown()


def _pp(rank: int, world: int, port: int, ckpts: dict[str, str], res: dict) -> None:
    batch = make_batch()
    w = make_worker(rank, world, port, ckpts["llama"], pp=2, algo=AlgoConfig(temperature=0.7))
    res["pp/llama/logp"] = w.compute_logprobs(batch)
    res["pp/llama/weights"] = weights(w)
    w.shutdown()
    # qwen2 ties its embeddings: the last stage holds megatron's extra copy for the output layer
    w = make_worker(rank, world, port + 1, ckpts["qwen2"], pp=2, algo=AlgoConfig(temperature=0.7))
    res["pp/pp_rank"], res["pp/source"] = w.pp_rank, w.is_weight_source
    res["pp/logp"] = w.compute_logprobs(batch)
    res["pp/weights"] = weights(w)
    res["pp/metadata"] = w.hf_weight_metadata()
    w.algo = AlgoConfig()
    res["pp/stats"] = w.forward_backward(batch, w.compute_logprobs(batch))
    res["pp/grad"] = hf_grads(w)
    t = time.perf_counter()
    res["pp/metrics"] = w.train_step(batch)
    res["pp/train_step_s"] = time.perf_counter() - t
    res["pp/after"] = weights(w)
    w.shutdown()


def _dp_dynamic(rank: int, world: int, port: int, ckpts: dict[str, str], res: dict) -> None:
    """DP=2 with token budgets: rank 0 holds one sample, rank 1 three (bins {12}, {9}, {7} at a
    budget of 12), so rank 0 must run two zero-weight dummy micro-batches to match."""
    batch = make_batch()
    w = make_worker(rank, world, port, ckpts["qwen2"], use_dynamic_batch_size=True,
                    max_tokens_per_gpu=12)
    shard = select(batch, [2] if w.dp_rank == 0 else [0, 1, 3])
    old = w.compute_logprobs(shard)
    res["dyn/dp_rank"] = w.dp_rank
    res["dyn/groups"] = w.micro.equalized_groups(shard, list(range(len(old))), _dp_group(), w.info.device)
    for mode in ("token-mean", "seq-mean-token-mean"):
        w.loss_agg_mode = mode
        res[f"dyn/{mode}/stats"] = w.forward_backward(shard, old)
        res[f"dyn/{mode}/grad"] = hf_grads(w)
    w.shutdown()


def _dp_group():
    from slime_rl.trainer.parallel import dp_group

    return dp_group()


def scenario_par2(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    res: dict = {}
    for k, part in enumerate((_sp, _pp, _dp_dynamic)):
        t = time.perf_counter()
        part(rank, world, port + 10 * k, ckpts, res)
        res[f"time/{part.__name__}"] = time.perf_counter() - t
    return res


SCENARIOS = {"agg": scenario_agg, "par2": scenario_par2}
