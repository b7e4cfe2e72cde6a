"""Scenarios of PPO's critic (slime_rl.trainer.critic), run like trainer_scenarios.py
(`python -m tests.trainer.trainer_scenarios NAME ...` finds them here).

critic1 (world 1, TP=1): values in every layout, the head's weights (for the HF reference), one
train step, a save and a load into a fresh critic. critic2 (world 2: TP=2, TP=2 with
sequence parallel, PP=2): the same values and step.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile

from slime_rl.config.groups import AlgoConfig, BatchConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainerConfig
from tests.trainer.trainer_ref import make_batch, select

# hand-made targets for the value loss: one per response token of make_batch()
RETURNS = ([1.0, 0.5, -0.5], [0.0, 0.25, 0.5, 0.75, 1.0, 1.25], [2.0, -1.0], [0.3, 0.3, -0.3, 0.9])
VALUE_CLIP = 0.01


def make_critic(rank: int, world: int, port: int, ckpt: str, tp: int = 1, mbs: int = 2, gbs: int = 4, pp: int = 1,
                **kw):
    from slime_rl.trainer.critic import CriticWorker

    return CriticWorker(rank, world, "127.0.0.1", port,
                        ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                       actor_num_gpus_per_node=world),
                        BatchConfig(micro_batch_size=mbs, global_batch_size=gbs),
                        OptimizerConfig(lr=1e-4, clip_grad=0.0, weight_decay=0.0, lr_decay_style="constant"),
                        ModelConfig(hf_checkpoint=ckpt),
                        AlgoConfig(advantage_estimator="ppo", value_clip=VALUE_CLIP), train_iters=10,
                        trainer=TrainerConfig(**kw))


def _step(w, batch: dict, res: dict, prefix: str) -> None:
    """Values before, one train step (one mini-batch of 4: the first forward equals the old values,
    so the value clip only acts from the second optimizer step on), values after."""
    old = w.compute_values(batch)
    res[f"{prefix}/values"] = old
    res[f"{prefix}/metrics"] = w.train_step(batch, old, [list(r) for r in RETURNS])
    res[f"{prefix}/after"] = w.compute_values(batch)


def scenario_critic1(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    batch, res = make_batch(), {}
    w = make_critic(rank, world, port, ckpts["qwen2"], pack_sequences=False, mbs=4)
    res["padded/values"] = w.compute_values(batch)
    w.micro = dataclasses.replace(w.micro, pack_sequences=True)
    res["packed/values"] = w.compute_values(batch)  # one THD row with all 4 samples
    res["alone/values"] = [w.compute_values(select(batch, [i]))[0] for i in range(4)]
    head = w.gpt.output_layer
    res["head/weight"], res["head/bias"] = head.weight.detach().clone(), head.bias.detach().clone()
    res["tied"] = w.arch.tie_word_embeddings
    res["params"] = sorted(n for n, _ in w.gpt.named_parameters())
    w.micro = dataclasses.replace(w.micro, micro_batch_size=2)
    _step(w, batch, res, "tp1")
    # --critic-save / --critic-load: a fresh critic restores the trained one (value head included)
    root = tempfile.mkdtemp(prefix="critic_ckpt_")
    w.save_checkpoint(root, 0, {"rollout_id": 0})
    w.shutdown()
    w = make_critic(rank, world, port + 2, ckpts["qwen2"])
    res["reload/extra"] = w.load_latest_checkpoint(root)
    res["reload/values"] = w.compute_values(batch)
    w.shutdown()
    shutil.rmtree(root)
    # Llama (untied): the LM head is replaced too; two mini-batches, so the clip acts in the second
    w = make_critic(rank, world, port + 1, ckpts["llama"], gbs=2)
    _step(w, batch, res, "llama")
    w.shutdown()
    return res


def scenario_critic2(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    batch, res = make_batch(), {"tp_rank": None}
    w = make_critic(rank, world, port, ckpts["qwen2"], tp=2)
    res["tp_rank"] = w.tp_rank
    _step(w, batch, res, "tp2")
    w.shutdown()
    w = make_critic(rank, world, port + 1, ckpts["qwen2"], tp=2, sequence_parallel=True)
    _step(w, batch, res, "sp")
    w.shutdown()
    # PP=2 of the tied qwen2: the head lives on the last stage, the embedding is no longer shared
    w = make_critic(rank, world, port + 2, ckpts["qwen2"], pp=2)
    _step(w, batch, res, "pp")
    w.shutdown()
    return res


SCENARIOS = {"critic1": scenario_critic1, "critic2": scenario_critic2}
