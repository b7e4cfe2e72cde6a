"""Scenarios for issue 3 (packing, token budgets, loss aggregation, PP, sequence parallel), run like
trainer_scenarios.py (`python -m tests.trainer.trainer_scenarios NAME ...` finds them here).

The equivalence scenarios (equiv1, cp2, equiv4, gpu1, gpu2) run `run_equiv` per parallel layout.
World-2 checks share one process pair ("par2") because each process pays ~10 s of megatron import.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

from slime_rl.config.groups import AlgoConfig, BatchConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainerConfig
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


# ---- equivalence with one rank (issue 3): every layout records, for the fixed batch at
# temperature 1, the log-probs of its samples, the mini-batch stats, the full gradient (HF names)
# and the grad norm megatron's optimizer computes (before clipping; no step is taken)
EQUIV = {  # name: (tp, pp, cp); DP is what is left of the world
    "base": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "cp2": (1, 1, 2),
    "tp2pp2": (2, 2, 1), "tp2dp2": (2, 1, 1), "tp2cp2": (2, 1, 2), "pp2cp2": (1, 2, 2), "cp2dp2": (1, 1, 2),
    "tp2cp2sp": (2, 1, 2),
}
# layouts other than padded + packed, and worker options (sequence parallel needs packing)
EQUIV_LAYOUTS = {"tp2cp2sp": ("packed",)}
EQUIV_KW = {"tp2cp2sp": {"sequence_parallel": True}}


def _equiv_worker(rank: int, world: int, port: int, ckpt: str, tp: int, pp: int, cp: int, bf16: bool, ep: int = 1,
                  **kw):
    from slime_rl.trainer.worker import TrainerWorker

    return TrainerWorker(rank, world, "127.0.0.1", port,
                         ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                        actor_num_gpus_per_node=world, context_parallel_size=cp,
                                        expert_model_parallel_size=ep),
                         BatchConfig(micro_batch_size=2, global_batch_size=4),
                         OptimizerConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.0, lr_decay_style="constant"),
                         ModelConfig(hf_checkpoint=ckpt, bf16=bf16),
                         AlgoConfig(), train_iters=10, trainer=TrainerConfig(**kw))


def dp_shard(w, batch: dict, name: str, res: dict, group_rank: int | None = None) -> list[int]:
    """This DP rank's samples of `batch` (contiguous, in order), recorded under `{name}/ids` with the rank's
    (tp, pp, `group_rank`, dp) coordinates (`group_rank`: the CP or EP rank a scenario checks; CP's by default)."""
    n = len(batch["tokens"]) // w.dp_size
    ids = list(range(w.dp_rank * n, (w.dp_rank + 1) * n))
    res[f"{name}/ids"] = ids
    res[f"{name}/ranks"] = (w.tp_rank, w.pp_rank, w.info.cp_rank if group_rank is None else group_rank, w.dp_rank)
    return ids


def record_export(w, rank: int, tag: str, name: str, res: dict) -> None:
    """`{name}/exported` on global rank 0: the folder --save-hf's gather (hf_export.py) writes from every rank,
    read back (a temporary folder named by `tag`, removed after)."""
    out = Path(tempfile.gettempdir(), f"slime_rl_{tag}_export_{name}")
    w.save_hf(str(out))
    if rank == 0:
        res[f"{name}/exported"] = {k: v.clone() for f in sorted(out.glob("*.safetensors"))
                                   for k, v in load_file(f).items()}
        shutil.rmtree(out)


def record_layouts(w, shard: dict, layouts: tuple[str, ...], name: str, res: dict) -> None:
    """`{name}/{layout}/...` of one shard in each micro-batch layout: log-probs, a forward-backward's
    stats, the HF-named grads, the grad norm and the seconds it took."""
    for layout in layouts:
        w.micro = dataclasses.replace(w.micro, pack_sequences=layout == "packed")
        key = f"{name}/{layout}"
        t = time.perf_counter()
        res[f"{key}/logp"] = logp = w.compute_logprobs(shard)
        res[f"{key}/stats"] = w.forward_backward(shard, logp)
        res[f"{key}/grad"] = hf_grads(w)
        w.optimizer.prepare_grads()  # model grads -> main grads, as step() does before the norm
        res[f"{key}/grad_norm"] = float(w.optimizer.get_grad_norm())
        res[f"{key}/s"] = time.perf_counter() - t


def run_equiv(rank: int, world: int, port: int, ckpt: str, name: str, res: dict, bf16: bool = False) -> None:
    """Records `{name}/{layout}/...` of config `name` (EQUIV). DP ranks take consecutive shards."""
    tp, pp, cp = EQUIV[name]
    batch = make_batch()
    w = _equiv_worker(rank, world, port, ckpt, tp, pp, cp, bf16, **EQUIV_KW.get(name, {}))
    layouts = EQUIV_LAYOUTS.get(name, ("padded", "packed"))
    shard = select(batch, dp_shard(w, batch, name, res))
    res["device"], res["params_dtype"] = w.info.device.type, str(w.gpt.config.params_dtype)
    record_layouts(w, shard, layouts, name, res)
    w.shutdown()


def _equiv_scenario(names: tuple[str, ...], bf16: bool = False):
    def scenario(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
        res: dict = {}
        for k, name in enumerate(names):
            run_equiv(rank, world, port + 10 * k, ckpts["qwen2"], name, res, bf16)
        return res

    return scenario


def scenario_pp_uneven(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    """PP=2 over the 4-layer Qwen2 with an uneven split, both ways: --decoder-first-pipeline-num-layers 1
    (stages of 1 and 3 layers) and --decoder-last-pipeline-num-layers 1 (3 and 1). Each records the fixed
    batch's log-probs, a forward-backward's stats and grads (HF names), and the weights its stage sends
    (iter_hf_weights)."""
    from slime_rl.trainer.worker import TrainerWorker

    res: dict = {}
    batch = make_batch()
    for k, (name, first, last) in enumerate((("first1", 1, None), ("last1", None, 1))):
        w = TrainerWorker(rank, world, "127.0.0.1", port + 10 * k,
                          ParallelConfig(pipeline_model_parallel_size=2, actor_num_gpus_per_node=world,
                                         decoder_first_pipeline_num_layers=first,
                                         decoder_last_pipeline_num_layers=last),
                          BatchConfig(micro_batch_size=2, global_batch_size=4),
                          OptimizerConfig(lr=1e-3, weight_decay=0.0, lr_decay_style="constant"),
                          ModelConfig(hf_checkpoint=ckpts["qwen2_4l"]), AlgoConfig(), train_iters=10)
        res[f"{name}/layers"] = len(w.gpt.decoder.layers)
        res[f"{name}/logp"] = logp = w.compute_logprobs(batch)
        res[f"{name}/stats"] = w.forward_backward(batch, logp)
        res[f"{name}/grad"] = hf_grads(w)
        res[f"{name}/weights"] = {n: t.clone() for n, t in w.iter_hf_weights()}
        w.shutdown()
    return res


SCENARIOS = {"agg": scenario_agg, "par2": scenario_par2, "pp_uneven": scenario_pp_uneven,
             "equiv1": _equiv_scenario(("base",)), "cp2": _equiv_scenario(("cp2",)),
             # world 4, split in two so that each run stays well inside run_scenario's timeout
             # on a loaded 2-core machine (4 processes, ~10 s of megatron import each)
             "equiv4": _equiv_scenario(("tp2pp2", "tp2dp2", "tp2cp2")),
             "equiv4cp": _equiv_scenario(("pp2cp2", "cp2dp2", "tp2cp2sp")),
             # the GPU test (tests/gpu/test_gpu_parallel.py): bf16, one rank vs two
             "gpu1": _equiv_scenario(("base",), bf16=True), "gpu2": _equiv_scenario(("tp2", "pp2", "cp2"), bf16=True)}


def equiv_diffs(base: list[dict], ranks: list[dict], name: str, layout: str) -> dict[str, float]:
    """Max differences of config `name` (all its ranks) from the one-rank run `base`, same layout:
    logp (max |diff| over every response token), grad (max |diff| over every gradient element,
    HF names, stages merged), grad_norm_rel (max over ranks of |norm - norm_1| / norm_1), loss."""
    (one,) = base
    want, got = f"base/{layout}", f"{name}/{layout}"
    logp = 0.0
    grads: dict = {}
    for rec in ranks:
        for i, row in zip(rec[f"{name}/ids"], rec[f"{got}/logp"], strict=True):
            ref = one[f"{want}/logp"][i]
            assert len(row) == len(ref), (name, layout, i)
            logp = max(logp, *(abs(a - b) for a, b in zip(row, ref, strict=True)))
        grads.update(rec[f"{got}/grad"])
    assert set(grads) == set(one[f"{want}/grad"]), (name, layout)
    grad = max(float((grads[k].float() - g.float()).abs().max()) for k, g in one[f"{want}/grad"].items())
    norm = one[f"{want}/grad_norm"]
    return {"logp": logp, "grad": grad,
            "grad_norm_rel": max(abs(r[f"{got}/grad_norm"] - norm) / norm for r in ranks),
            "loss": max(abs(r[f"{got}/stats"]["loss"] - one[f"{want}/stats"]["loss"]) for r in ranks)}
