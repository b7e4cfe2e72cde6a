"""LoRA scenarios (run by tests/trainer/test_lora.py through trainer_scenarios.run_scenario).

The tiny Qwen2 (`qwen2`: GQA 4/2, qkv bias, tied embeddings) with rank-4 adapters on every linear. Each
layout records the same things, which the test compares with one rank and with PEFT's own model:
the log-probs with the adapters at their start (B = 0) and off, then with seeded random B (so every
adapter matters), the adapters' gradients, the merged weights weight sync sends, one train step.
"""

from __future__ import annotations

import hashlib

import torch

from slime_rl.config.groups import AlgoConfig, BatchConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainerConfig
from tests.trainer.trainer_ref import make_batch, select

RANK, ALPHA = 4, 8.0  # scale 2


def lora_worker(rank: int, world: int, port: int, ckpt: str, tp: int = 1, pp: int = 1, sp: bool = False,
                targets: tuple[str, ...] = ("all-linear",), cp: int = 1, **model):
    from slime_rl.trainer.worker import TrainerWorker

    return TrainerWorker(rank, world, "127.0.0.1", port,
                         ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                        actor_num_gpus_per_node=world, context_parallel_size=cp),
                         BatchConfig(micro_batch_size=2, global_batch_size=4),
                         OptimizerConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.0, lr_decay_style="constant"),
                         ModelConfig(hf_checkpoint=ckpt, lora_rank=RANK, lora_alpha=ALPHA,
                                     lora_target_modules=targets, **model),
                         AlgoConfig(), train_iters=10, trainer=TrainerConfig(sequence_parallel=sp))


def random_b(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT-named adapters with every lora_B drawn from a generator seeded by its name (whole tensors, so
    every layout gets the same)."""
    out = {}
    for k, v in state.items():
        if ".lora_B." in k:
            seed = int.from_bytes(hashlib.sha256(k.encode()).digest()[:4], "little")
            v = torch.randn(v.shape, generator=torch.Generator().manual_seed(seed)) * 0.3
        out[k] = v
    return out


def _grads(w) -> dict[str, torch.Tensor]:
    from slime_rl.trainer import lora
    from slime_rl.trainer.parallel import tp_group
    from tests.trainer.trainer_scenarios import _gather_dp_grad_shards

    if w.dp_size * w.info.cp_size > 1:  # the distributed optimizer's grad shards over DP x CP
        _gather_dp_grad_shards(w)
    return lora.peft_state(w.lora, tp_group(), get=lambda p: p.main_grad.detach().float())


def record(w, batch: dict) -> dict:
    from slime_rl.trainer import lora
    from slime_rl.trainer.parallel import tp_group

    res: dict = {"init/logp": w.compute_logprobs(batch)}
    lora.set_enabled(w.gpt, False)
    res["off/logp"] = w.compute_logprobs(batch)
    lora.set_enabled(w.gpt, True)
    res["trainable"] = sum(p.numel() for p in w.gpt.parameters() if p.requires_grad)
    res["frozen_in_optimizer"] = sum(1 for g in w.optimizer.param_groups for p in g["params"]
                                     if not getattr(p, "requires_grad", True))
    state = random_b(lora.peft_state(w.lora, tp_group()))
    lora.load_peft_state(w.lora, state, "test")
    res["state"] = lora.peft_state(w.lora, tp_group())
    res["logp"] = w.compute_logprobs(batch)
    old = res["logp"]
    w.forward_backward(batch, old)
    res["grads"] = _grads(w)
    res["merged"] = {n: t.clone() for n, t in w.iter_hf_weights()}
    base = {n: p.detach().clone() for n, p in w.gpt.named_parameters() if not lora.is_adapter_name(n)}
    res["metrics"] = w.train_step(batch)
    res["base_unchanged"] = all(torch.equal(p, base[n]) for n, p in w.gpt.named_parameters()
                                if not lora.is_adapter_name(n))
    res["state_after"] = lora.peft_state(w.lora, tp_group())
    res["merged_after"] = {n: t.clone() for n, t in w.iter_hf_weights()}
    return res


def _layout(rank: int, world: int, port: int, ckpts: dict[str, str], **kw) -> dict:
    w = lora_worker(rank, world, port, ckpts["qwen2"], **kw)
    batch = make_batch()
    if w.dp_size > 1:  # DP rank r trains samples {2r, 2r + 1} of the one-rank batch
        batch = select(batch, [2 * w.dp_rank, 2 * w.dp_rank + 1])
    res = record(w, batch) | {"dp_rank": w.dp_rank}
    w.shutdown()
    return res


def scenario_lora_one(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    """One rank, and the PEFT export of the adapters with random B (written by the trainer's own export)."""
    w = lora_worker(rank, world, port, ckpts["qwen2"])
    res = record(w, make_batch())
    from slime_rl.trainer import lora

    lora.load_peft_state(w.lora, res["state"], "test")  # the pre-step adapters, whose log-probs are res["logp"]
    res["export"] = w.save_peft(ckpts["out"] + "/adapter")
    w.shutdown()
    # --lora-load of the export: the same adapters, so the same log-probs
    w = lora_worker(rank, world, port + 1, ckpts["qwen2"], lora_load=res["export"])
    res["loaded/logp"] = w.compute_logprobs(make_batch())
    res["loaded/spec"] = w.lora_spec
    w.shutdown()
    # --lora-dropout 0.5 with the same adapters: the log-prob forward runs without it, the training forward with it
    w = lora_worker(rank, world, port + 2, ckpts["qwen2"], lora_dropout=0.5)
    lora.load_peft_state(w.lora, res["state"], "test")
    res["dropout/logp"] = w.compute_logprobs(make_batch())
    w.forward_backward(make_batch(), res["dropout/logp"])
    res["dropout/grads"] = _grads(w)
    w.shutdown()
    return res


def _steps(w, n: int) -> list[dict]:
    from slime_rl.trainer import lora
    from slime_rl.trainer.parallel import tp_group

    out = []
    for i in range(n):
        metrics = w.train_step(make_batch(seed=i))
        out.append({"metrics": metrics, "state": lora.peft_state(w.lora, tp_group())})
    return out


def scenario_lora_resume(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    """4 steps unbroken, saving after step 2; a new trainer resumed from that save runs steps 3-4. Then a
    LoRA trainer loading a checkpoint without adapters (the base's, tools/convert_hf_to_megatron.py)."""
    from slime_rl.trainer import lora
    from slime_rl.trainer.parallel import tp_group

    root = ckpts["out"] + "/resume"
    w = lora_worker(rank, world, port, ckpts["qwen2"], tp=world)
    res: dict = {"unbroken": _steps(w, 2)}
    w.save_checkpoint(root, 2, {"rollout_id": 1})
    res["unbroken"] += [{"metrics": w.train_step(make_batch(seed=i)), "state": lora.peft_state(w.lora, tp_group())}
                        for i in (2, 3)]
    w.shutdown()
    w = lora_worker(rank, world, port + 1, ckpts["qwen2"], tp=world)
    res["extra"] = w.load_latest_checkpoint(root)
    res["resumed"] = [{"metrics": w.train_step(make_batch(seed=i)), "state": lora.peft_state(w.lora, tp_group())}
                      for i in (2, 3)]
    w.shutdown()
    w = lora_worker(rank, world, port + 2, ckpts["qwen2"], tp=world)
    res["fresh/logp"] = w.compute_logprobs(make_batch())
    res["fresh/state"] = lora.peft_state(w.lora, tp_group())
    w.load_latest_checkpoint(ckpts["base_mcore"])
    res["base_ckpt/logp"] = w.compute_logprobs(make_batch())
    res["base_ckpt/state"] = lora.peft_state(w.lora, tp_group())
    res["base_ckpt/metrics"] = w.train_step(make_batch())
    w.shutdown()
    return res


def scenario_lora_tp2(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    res = {f"tp2/{k}": v for k, v in _layout(rank, world, port, ckpts, tp=2).items()}
    res |= {f"tp2sp/{k}": v for k, v in _layout(rank, world, port + 1, ckpts, tp=2, sp=True).items()}
    res |= {f"cp2/{k}": v for k, v in _layout(rank, world, port + 2, ckpts, cp=2).items()}
    return res


def scenario_lora_pp2(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    return _layout(rank, world, port, ckpts, pp=2)


def scenario_lora_dp2(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    return _layout(rank, world, port, ckpts)


SCENARIOS = {"lora_one": scenario_lora_one, "lora_resume": scenario_lora_resume, "lora_tp2": scenario_lora_tp2,
             "lora_pp2": scenario_lora_pp2,
             "lora_dp2": scenario_lora_dp2}
