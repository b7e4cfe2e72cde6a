"""Multi-rank trainer scenarios, one process per rank (run by the tests through `run_scenario`).

    python -m tests.trainer.trainer_scenarios SCENARIO RANK WORLD PORT OUT_DIR CKPT_JSON

Each scenario records what the tests assert on into OUT_DIR/<scenario>_rank<RANK>.pt; several
checks share one process because importing megatron costs ~10 s per process.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slime_rl.config.groups import AlgoConfig, BatchConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainerConfig
from slime_rl.trainer.debug_data import TrainDataDump
from tests.procs import run_processes
from tests.trainer.trainer_ref import make_batch, select

ROOT = Path(__file__).resolve().parents[2]


def make_worker(rank: int, world: int, port: int, ckpt: str, tp: int = 1, mbs: int = 2, gbs: int = 4,
                algo: AlgoConfig | None = None, bf16: bool = False, pp: int = 1,
                freeze_vision_tower: bool = False, pad_vocab_multiple: int = 1, **kw):
    from slime_rl.trainer.worker import TrainerWorker

    return TrainerWorker(rank, world, "127.0.0.1", port,
                         ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                        actor_num_gpus_per_node=world),
                         BatchConfig(micro_batch_size=mbs, global_batch_size=gbs),
                         OptimizerConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.0, lr_decay_style="constant"),
                         ModelConfig(hf_checkpoint=ckpt, bf16=bf16, freeze_vision_tower=freeze_vision_tower),
                         algo or AlgoConfig(), train_iters=10, pad_vocab_multiple=pad_vocab_multiple,
                         trainer=TrainerConfig(**kw))


def weights(w) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in w.iter_hf_weights()}


def _gather_dp_grad_shards(w) -> None:
    """The distributed optimizer reduce-scatters grads over DP: each rank's grad buffer holds the
    DP-reduced values only on its own shard. All-gather the shards so main_grad is whole (test
    only: the optimizer step reads just the local shard, so this changes nothing it uses)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    # megatron's DDP and distributed optimizer work over the DP x CP group (CP ranks hold shards too);
    # an MoE model's expert parameters over the expert-DP group
    dense = mpu.get_data_parallel_group(with_context_parallel=True)
    expert = mpu.get_expert_data_parallel_group() if getattr(w.model, "expert_parallel_buffers", None) else None
    for buffer, group in [*((b, dense) for b in w.model.buffers),
                          *((b, expert) for b in getattr(w.model, "expert_parallel_buffers", []))]:
        dp, r = dist.get_world_size(group), dist.get_rank(group)
        for bucket in buffer.buckets:
            shards = shard_buffer(bucket.grad_data, dp)
            gathered = [torch.empty_like(shards[r]) for _ in range(dp)]
            dist.all_gather(gathered, shards[r].contiguous(), group=group)
            for dst, src in zip(shards, gathered, strict=True):
                dst.copy_(src)


def hf_grads(w) -> dict[str, torch.Tensor]:
    """main_grad of every parameter of this pipeline stage after forward_backward, gathered over
    TP (ETP and EP for an MoE model's experts) into (global) HF names."""
    from slime_rl.trainer.hf_io import iter_hf_tensors

    if w.dp_size * w.info.cp_size > 1:
        _gather_dp_grad_shards(w)
    # frozen parameters (GLM-5's sparse-attention indexer) have no gradient
    return {n: t.clone() for n, t in iter_hf_tensors(w.gpt, w.arch, lambda p: p.main_grad.detach(), skip_frozen=True)}


def scenario_tp1(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    batch, res, qwen2 = make_batch(), {}, ckpts["qwen2"]
    hot = AlgoConfig(temperature=0.7)
    # bf16 smoke run: Float16Module + the fp32-main-param optimizer path
    w = make_worker(rank, world, port, qwen2, algo=hot, bf16=True)
    port += 1
    res["bf16/logp"] = w.compute_logprobs(batch)
    views = list(w.iter_hf_sources())  # weight sync's cached TP=1 views, taken before the step
    res["bf16/metrics"] = w.train_step(batch)
    res["bf16/dtypes"] = sorted({str(t.dtype) for _, t in w.iter_hf_weights()})
    # after the optimizer step the same view objects are handed out and read the new weights
    fresh = weights(w)
    res["bf16/views_reused"] = all(a[1] is b[1] for a, b in zip(views, w.iter_hf_sources(), strict=True))
    res["bf16/views_current"] = ([n for n, _, _ in views] == list(fresh)
                                 and all(torch.equal(src.reshape(shape), fresh[n]) for n, src, shape in views))
    w.shutdown()
    for name, ckpt, kw in (("llama", ckpts["llama"], {}), ("qwen3", ckpts["qwen3"], {}),
                           ("qwen2_pad", qwen2, {"pad_vocab_multiple": 48}), ("qwen2", qwen2, {})):
        w = make_worker(rank, world, port, ckpt, algo=hot, **kw)
        port += 1
        res[f"{name}/logp"] = w.compute_logprobs(batch)
        res[f"{name}/padded_vocab"] = w.arch.padded_vocab_size
        if name != "qwen2":
            w.shutdown()
    # gradient at temperature 1: micro-batch size 2 (2 micro-batches) vs 1 (4 micro-batches)
    w.algo = AlgoConfig()
    old = w.compute_logprobs(batch)
    res["stats_mbs2"] = w.forward_backward(batch, old)
    res["grad_mbs2"] = hf_grads(w)
    w.batch = BatchConfig(micro_batch_size=1, global_batch_size=4)
    w.micro = dataclasses.replace(w.micro, micro_batch_size=1)  # the worker's micro-batching
    res["stats_mbs1"] = w.forward_backward(batch, old)
    res["grad_mbs1"] = hf_grads(w)
    res["before"] = weights(w)
    dumps = Path(tempfile.mkdtemp(prefix="train_data_"))  # --save-debug-train-data of both paths
    t = time.perf_counter()
    res["metrics"] = w.train_step(batch, dump=TrainDataDump(str(dumps / "fused.pt"), 5))
    res["train_step_s"] = time.perf_counter() - t
    res["after"] = weights(w)
    w.shutdown()
    # the same step with the old log-probs from their own forward pass (the fused path above)
    w = make_worker(rank, world, port, qwen2, algo=AlgoConfig(separate_old_logprobs=True))
    port += 1
    res["separate/metrics"] = w.train_step(batch, dump=TrainDataDump(str(dumps / "separate.pt"), 5))
    res["separate/after"] = weights(w)
    w.shutdown()
    res["dump/fused"], res["dump/separate"] = (torch.load(dumps / f"{k}.pt") for k in ("fused", "separate"))
    # reference model: 2 mini-batches, so the second one has moved away from the reference
    w = make_worker(rank, world, port, qwen2, mbs=1, gbs=2,
                    algo=AlgoConfig(kl_loss_coef=0.1, kl_loss_type="low_var_kl"))
    res["kl/initial_logp"] = w.compute_logprobs(batch)
    res["kl/metrics"] = w.train_step(batch)
    res["kl/trained"] = weights(w)
    with w.reference_weights():
        res["kl/ref_logp"] = w.compute_logprobs(batch)
    res["kl/restored"] = weights(w)
    w.shutdown()
    return res


def scenario_tp2(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    batch, res = make_batch(), {}
    for family in ("llama", "qwen3"):
        w = make_worker(rank, world, port, ckpts[family], tp=2, algo=AlgoConfig(temperature=0.7))
        port += 1
        res[f"{family}/logp"] = w.compute_logprobs(batch)
        res[f"{family}/weights"] = weights(w)
        w.shutdown()
    w = make_worker(rank, world, port, ckpts["qwen2"], tp=2, algo=AlgoConfig(temperature=0.7))
    res["tp_rank"] = w.tp_rank
    res["qwen2/logp"] = w.compute_logprobs(batch)
    res["qwen2/weights"] = weights(w)
    res["qwen2/metadata"] = w.hf_weight_metadata()
    res["qwen2/sources"] = {n: src.reshape(shape).clone() for n, src, shape in w.iter_hf_sources()}  # TP=2: gathered
    w.algo = AlgoConfig()
    res["stats"] = w.forward_backward(batch, w.compute_logprobs(batch))
    res["grad"] = hf_grads(w)
    res["metrics"] = w.train_step(batch)
    w.shutdown()
    return res


def scenario_dp2(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    """TP=1, DP=2: rank r trains samples {2r, 2r+1} with micro-batch size 1 (2 micro-batches)."""
    w = make_worker(rank, world, port, ckpts["qwen2"], mbs=1, gbs=4)
    shard = select(make_batch(), [2 * w.dp_rank, 2 * w.dp_rank + 1])
    res = {"dp_rank": w.dp_rank, "dp_size": w.dp_size, "metrics": w.train_step(shard), "after": weights(w)}
    w.shutdown()
    return res


SCENARIOS = {"tp1": scenario_tp1, "tp2": scenario_tp2, "dp2": scenario_dp2}


def scenario_runner(out: Path, ckpts: dict[str, Any]) -> Callable[[str, int], list[dict]]:
    """`get(name, world)`: each scenario's per-rank records, run once (on a fresh port) and cached."""
    from tests.conftest import free_port

    cache: dict[str, list[dict]] = {}

    def get(name: str, world: int) -> list[dict]:
        if name not in cache:
            cache[name] = run_scenario(name, world, free_port(), out, ckpts)
        return cache[name]

    return get


def run_scenario(name: str, world: int, port: int, out: Path, ckpts: dict[str, Path],
                 timeout: float = 300, tries: int = 3) -> list[dict]:
    """Run a scenario in `world` processes; returns each rank's record (raises with the logs).
    `ckpts` maps family -> HF folder (qwen2, llama, qwen3). A free port can be taken by another
    process before rank 0 binds it (seen on the GPU machine): then run again on a new port."""
    from tests.conftest import free_port

    for attempt in range(tries):
        try:
            return _run_scenario_once(name, world, port, out, ckpts, timeout)
        except RuntimeError as exc:
            # torch's store says EADDRINUSE; engines/dist_group.tcp_store's own bind "Address already in use"
            if not any(m in str(exc) for m in ("EADDRINUSE", "Address already in use")) or attempt == tries - 1:
                raise
            port = free_port()
    raise AssertionError("unreachable")


def _run_scenario_once(name: str, world: int, port: int, out: Path, ckpts: dict[str, Path],
                       timeout: float) -> list[dict]:
    ckpt_json = json.dumps({k: str(v) for k, v in ckpts.items()})
    run_processes([[sys.executable, "-m", "tests.trainer.trainer_scenarios", name, str(r), str(world), str(port),
                    str(out), ckpt_json] for r in range(world)], f"scenario {name}", timeout)
    return [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in range(world)]


def main() -> None:
    name, rank, world, port, out, ckpt_json = sys.argv[1:7]
    torch.manual_seed(0)
    from tests.trainer import (
        algo_scenarios,
        critic_scenarios,
        glm4_scenarios,
        lora_scenarios,
        minimax_m2_scenarios,
        moe_scenarios,
        mtp_scenarios,
        parallel_scenarios,
        qwen3_next_scenarios,
        ref_load_scenarios,
        routing_replay_scenarios,
        vl_scenarios,
    )

    func = SCENARIOS.get(name) or {**parallel_scenarios.SCENARIOS, **algo_scenarios.SCENARIOS,
                                   **critic_scenarios.SCENARIOS, **vl_scenarios.SCENARIOS,
                                   **ref_load_scenarios.SCENARIOS, **moe_scenarios.SCENARIOS,
                                   **routing_replay_scenarios.SCENARIOS, **lora_scenarios.SCENARIOS,
                                   **glm4_scenarios.SCENARIOS, **minimax_m2_scenarios.SCENARIOS,
                                   **qwen3_next_scenarios.SCENARIOS, **mtp_scenarios.SCENARIOS}[name]
    res = func(int(rank), int(world), int(port), json.loads(ckpt_json))
    res = {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in res.items()}
    torch.save(_to_cpu(res), Path(out) / f"{name}_rank{rank}.pt")


def _to_cpu(x):
    """Records are compared with CPU references, also when the ranks ran on GPUs."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


if __name__ == "__main__":
    main()
