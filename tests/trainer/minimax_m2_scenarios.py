"""MiniMax-M2 (minimax_m2) scenarios, run like trainer_scenarios.py (`python -m tests.trainer.trainer_scenarios NAME
...` finds them here), on the tiny checkpoint ckpts["minimax_m2"].

One launch of two ranks runs four layouts in turn: DP=2 (each rank one rank's whole model), TP=2 with sequence
parallelism (the q/k norms gather the two ranks' heads; the experts split over ETP=2), PP=2 (one layer per stage)
and EP=2 (four experts per rank). Each records, on the fixed batch at temperature 1, the log-probs of its DP shard,
a forward-backward's stats, the full gradient in HF names (gathered over TP, EP, DP), the grad norm megatron's
optimizer computes, the attention's class and its q/k norm weights' shapes and flags, the HF tensors weight sync
would send (iter_hf_weights and the cached sources) and --save-hf's folder; TP=2 also takes an optimizer step, saves
a checkpoint, spoils the q/k norms and loads it back.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from slime_rl.config.groups import AlgoConfig, BatchConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainerConfig
from tests.trainer.parallel_scenarios import dp_shard, record_export, record_layouts
from tests.trainer.trainer_ref import make_batch, select
from tests.trainer.trainer_scenarios import weights

# name: (tp, pp, ep); DP is what is left of the world
MINIMAX_LAYOUTS = {"dp2": (1, 1, 1), "tp2sp": (2, 1, 1), "pp2": (1, 2, 1), "ep2": (1, 1, 2)}
MINIMAX_KW = {"tp2sp": {"sequence_parallel": True}}
MINIMAX_RUN_LAYOUTS = {"dp2": ("padded", "packed"), "tp2sp": ("packed",), "pp2": ("packed",), "ep2": ("padded",)}


def run_minimax(rank: int, world: int, port: int, ckpt: str, name: str, res: dict) -> None:
    from slime_rl.trainer.worker import TrainerWorker

    tp, pp, ep = MINIMAX_LAYOUTS[name]
    batch = make_batch()
    w = TrainerWorker(rank, world, "127.0.0.1", port,
                      ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, actor_num_gpus_per_node=world),
                      BatchConfig(micro_batch_size=2, global_batch_size=4),
                      OptimizerConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.0, lr_decay_style="constant"),
                      ModelConfig(hf_checkpoint=ckpt), AlgoConfig(), train_iters=10,
                      trainer=TrainerConfig(**MINIMAX_KW.get(name, {})))
    ids = dp_shard(w, batch, name, res, w.info.ep_rank)
    config = w.gpt.config
    res[f"{name}/config"] = (config.sequence_parallel, config.qk_layernorm, config.moe_router_score_function,
                             config.moe_router_enable_expert_bias, config.moe_router_topk_scaling_factor,
                             w.gpt.rotary_pos_emb.inv_freq.numel() * 2)
    attn = [layer.self_attention for layer in w.gpt.decoder.layers]
    res[f"{name}/attention"] = sorted({type(a).__name__ for a in attn})
    res[f"{name}/qk_norms"] = sorted({(tuple(a.q_norm.weight.shape), tuple(a.k_norm.weight.shape),
                                       bool(getattr(a.q_norm.weight, "sequence_parallel", False)),
                                       type(a.q_layernorm).__name__) for a in attn})
    res[f"{name}/weights"] = weights(w)
    res[f"{name}/metadata"] = w.hf_weight_metadata()
    res[f"{name}/sources"] = {n: src.reshape(shape).clone() for n, src, shape in w.iter_hf_sources()}
    record_export(w, rank, f"minimax_m2_{port}", name, res)
    record_layouts(w, select(batch, ids), MINIMAX_RUN_LAYOUTS[name], name, res)
    if name == "tp2sp":  # the checkpoint (megatron's torch_dist) holds the whole-width norms: step, save, spoil, load
        root = Path(tempfile.gettempdir(), f"slime_rl_minimax_m2_ckpt_{port}")
        w.train_step(select(batch, ids))
        res[f"{name}/stepped"] = weights(w)
        w.save_checkpoint(str(root), 1, {"rollout_id": 1})
        with torch.no_grad():
            for a in attn:
                a.q_norm.weight.mul_(2.0)
                a.k_norm.weight.add_(1.0)
        res[f"{name}/spoilt"] = weights(w)
        res[f"{name}/resumed_extra"] = w.load_latest_checkpoint(str(root))
        res[f"{name}/resumed"] = weights(w)
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(root)
    w.shutdown()


def scenario_minimax_m2(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    res: dict = {}
    for k, name in enumerate(MINIMAX_LAYOUTS):
        run_minimax(rank, world, port + 10 * k, ckpts["minimax_m2"], name, res)
    return res


SCENARIOS = {"minimax_m2": scenario_minimax_m2}
