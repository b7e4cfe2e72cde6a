"""Mixture-of-experts scenarios (issue 22), run like trainer_scenarios.py
(`python -m tests.trainer.trainer_scenarios NAME ...` finds them here).

Each layout records, on the fixed batch at temperature 1 with a load-balancing loss on, the
log-probs of its DP shard, the mini-batch stats (with megatron's aux loss), the full gradient in HF
names (experts gathered over EP / ETP), the grad norm megatron's optimizer computes (before
clipping; no step is taken) and the HF tensors weight sync would send. "moe1" also runs without
the aux loss, so its gradient can be compared with HF's own (float64, no aux loss).
"""

from __future__ import annotations

from slime_rl.config.groups import AlgoConfig, BatchConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainerConfig
from tests.trainer.parallel_scenarios import dp_shard, record_export, record_layouts
from tests.trainer.trainer_ref import make_batch, select
from tests.trainer.trainer_scenarios import weights

AUX_COEFF = 0.01
MOE_LAYOUTS = {  # name: (tp, pp, ep); DP is what is left of the world, ETP = TP (megatron's default)
    "base": (1, 1, 1), "ep2": (1, 1, 2), "ep2tp2": (2, 1, 2), "ep2pp2": (1, 2, 2),
    "cp2ep2": (1, 1, 2), "ep2tp2etp1": (2, 1, 2), "ep2ag": (1, 1, 2),
    "ep2tp2ag": (2, 1, 2),
    # world 2 with the experts whole on every rank: TP=2 (sequence parallel), PP=2
    "tp2": (2, 1, 1), "pp2": (1, 2, 1), "cp2": (1, 1, 1), "pp2rc": (1, 2, 1),
}
MOE_CP = {"cp2ep2": 2, "cp2": 2}  # --context-parallel-size where not 1
MOE_ETP = {"ep2tp2etp1": 1}  # --expert-tensor-parallel-size where not the TP size


def _worker(rank: int, world: int, port: int, ckpt: str, tp: int, pp: int, ep: int, aux: float,
            cp: int = 1, etp: int | None = None, **kw):
    from slime_rl.trainer.worker import TrainerWorker

    return TrainerWorker(rank, world, "127.0.0.1", port,
                         ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                        actor_num_gpus_per_node=world, expert_model_parallel_size=ep,
                                        context_parallel_size=cp, expert_tensor_parallel_size=etp),
                         BatchConfig(micro_batch_size=2, global_batch_size=4),
                         OptimizerConfig(lr=1e-3, clip_grad=1.0), ModelConfig(hf_checkpoint=ckpt),
                         AlgoConfig(), train_iters=10, trainer=TrainerConfig(moe_aux_loss_coeff=aux, **kw))


def run_moe(rank: int, world: int, port: int, ckpt: str, name: str, res: dict, aux: float = AUX_COEFF,
            layouts: tuple[str, ...] = ("padded", "packed"), **kw) -> None:
    tp, pp, ep = MOE_LAYOUTS[name]
    batch = make_batch()
    w = _worker(rank, world, port, ckpt, tp, pp, ep, aux, MOE_CP.get(name, 1), MOE_ETP.get(name), **kw)
    shard = select(batch, dp_shard(w, batch, name, res, w.info.ep_rank))
    res[f"{name}/cp_etp"] = (w.info.cp_rank, w.info.etp_size)
    res[f"{name}/weights"] = weights(w)
    res[f"{name}/metadata"] = w.hf_weight_metadata()
    res[f"{name}/sources"] = {n: src.reshape(shape).clone() for n, src, shape in w.iter_hf_sources()}
    if world > 1:  # --save-hf's gather (hf_export.py): global rank 0 writes the folder, reads it back
        record_export(w, rank, f"moe_{port}", name, res)
    record_layouts(w, shard, layouts, name, res)
    w.shutdown()


def scenario_moe1(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    res: dict = {}
    run_moe(rank, world, port, ckpts["qwen3_moe"], "base", res)
    noaux: dict = {}
    run_moe(rank, world, port + 1, ckpts["qwen3_moe"], "base", noaux, aux=0.0, layouts=("packed",))
    res.update({f"noaux/{k}": v for k, v in noaux.items()})
    return res


# megatron's MoELayer refuses to train with TP > 1 without sequence parallelism (packed batches only)
MOE_KW = {"ep2tp2": {"sequence_parallel": True}, "tp2": {"sequence_parallel": True},
          # PP=2 with every layer's forward recomputed in the backward
          "pp2rc": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
          "ep2tp2etp1": {"sequence_parallel": True},
          # megatron's allgather dispatcher: every EP rank gathers all tokens and keeps its experts' share
          "ep2ag": {"moe_token_dispatcher_type": "allgather"},
          "ep2tp2ag": {"moe_token_dispatcher_type": "allgather", "sequence_parallel": True}}
MOE_RUN_LAYOUTS = {"ep2tp2": ("packed",), "tp2": ("packed",), "pp2rc": ("packed",), "ep2tp2etp1": ("packed",),
                   "ep2tp2ag": ("packed",)}


def _layouts(*names: str):
    def scenario(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
        res: dict = {}
        for k, name in enumerate(names):
            run_moe(rank, world, port + 10 * k, ckpts["qwen3_moe"], name, res,
                    layouts=MOE_RUN_LAYOUTS.get(name, ("padded", "packed")), **MOE_KW.get(name, {}))
        return res

    return scenario


# world 4: one layout per run, so that each stays inside run_scenario's timeout on a loaded machine
SCENARIOS = {"moe1": scenario_moe1, "moe_ep2": _layouts("ep2"), "moe_ep2tp2": _layouts("ep2tp2"),
             "moe_ep2pp2": _layouts("ep2pp2"),
             # context parallel (CP2 x EP2, DP2) and ETP1 under TP2 x EP2 (world 4)
             "moe_cp2ep2": _layouts("cp2ep2"), "moe_ep2tp2etp1": _layouts("ep2tp2etp1"),
             "moe_ep2ag": _layouts("ep2ag"), "moe_ep2tp2ag": _layouts("ep2tp2ag")}


def _qwen2_moe(*names: str, noaux: bool = False, key: str = "qwen2_moe"):
    """The same layouts on the tiny Qwen2-MoE (ckpts["qwen2_moe"]: shared expert, a dense layer) or
    another folder (`key`); with `noaux`, one rank also without the aux loss (compared with HF's own
    gradient)."""
    def scenario(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
        res: dict = {}
        for k, name in enumerate(names):
            run_moe(rank, world, port + 10 * k, ckpts[key], name, res,
                    layouts=MOE_RUN_LAYOUTS.get(name, ("padded", "packed")), **MOE_KW.get(name, {}))
        if noaux:
            extra: dict = {}
            run_moe(rank, world, port + 10 * len(names), ckpts[key], "base", extra, aux=0.0,
                    layouts=("packed",))
            res.update({f"noaux/{k}": v for k, v in extra.items()})
        return res

    return scenario


SCENARIOS.update({"qwen2_moe1": _qwen2_moe("base", noaux=True), "qwen2_moe_ep2": _qwen2_moe("ep2"),
                  "qwen2_moe_ep2tp2": _qwen2_moe("ep2tp2"), "qwen2_moe_ep2pp2": _qwen2_moe("ep2pp2"),
                  # the shared expert split over TP, the routed experts whole (ETP1)
                  "qwen2_moe_ep2tp2etp1": _qwen2_moe("ep2tp2etp1"),
                  # Qwen3-MoE with a dense first layer (mlp_only_layers=[0]), one rank vs HF
                  "qwen3_moe_mixed1": _qwen2_moe("base", noaux=True, key="qwen3_moe_mixed"),
                  # GLM-4.5 (glm4_moe): sigmoid routing with the expert bias and groups, an ungated
                  # shared expert, a dense first layer, q/k norms and half-rotated heads
                  "glm4_moe1": _qwen2_moe("base", noaux=True, key="glm4_moe"),
                  "glm4_moe_ep2": _qwen2_moe("ep2", key="glm4_moe"),
                  "glm4_moe_ep2tp2": _qwen2_moe("ep2tp2", key="glm4_moe"),
                  "glm4_moe_ep2pp2": _qwen2_moe("ep2pp2", key="glm4_moe"),
                  "glm4_moe_cp2ep2": _qwen2_moe("cp2ep2", key="glm4_moe"),
                  # DeepSeek-V3 (multi-latent attention over glm4_moe's MoE layout) and Moonlight's one q_proj
                  "deepseek_v31": _qwen2_moe("base", noaux=True, key="deepseek_v3"),
                  "moonlight1": _qwen2_moe("base", noaux=True, key="moonlight"),
                  **{f"deepseek_v3_{name}": _qwen2_moe(name, key="deepseek_v3")
                     for name in ("ep2", "ep2tp2", "ep2pp2", "cp2ep2")},
                  "moonlight_ep2tp2": _qwen2_moe("ep2tp2", key="moonlight"),
                  # DeepSeek-V3's YaRN on the rotary channels
                  "yarn1": _qwen2_moe("base", noaux=True, key="yarn"),
                  "glm4_moe_lite1": _qwen2_moe("base", noaux=True, key="glm4_moe_lite"),
                  "yarn_cp2ep2": _qwen2_moe("cp2ep2", key="yarn"), "yarn_ep2tp2": _qwen2_moe("ep2tp2", key="yarn"),
                  # GLM-5 (glm_moe_dsa): sparse attention over deepseek_v3's layout; TP=2, PP=2, EP=2, CP=2 and PP=2
                  # with recompute in one 2-rank launch
                  "glm_moe_dsa1": _qwen2_moe("base", noaux=True, key="glm_moe_dsa"),
                  "glm_moe_dsa_2ranks": _qwen2_moe("tp2", "pp2", "ep2", "cp2", "pp2rc", key="glm_moe_dsa")})


def scenario_glm4_moe_bf16(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    """One bf16 rank of the tiny GLM-4.5: the router's expert bias as the model holds it and as weight
    sync sends it (the engines keep the checkpoint's float32 values)."""
    from slime_rl.trainer.hf_io import model_tensors
    from slime_rl.trainer.worker import TrainerWorker

    w = TrainerWorker(rank, world, "127.0.0.1", port, ParallelConfig(actor_num_gpus_per_node=world),
                      BatchConfig(micro_batch_size=2, global_batch_size=4), OptimizerConfig(lr=1e-3),
                      ModelConfig(hf_checkpoint=ckpts["glm4_moe"], bf16=True), AlgoConfig(), train_iters=10)
    res = {"held": {n: t.detach().clone() for n, t in model_tensors(w.gpt).items() if n.endswith("expert_bias")},
           "sent": {n: src.reshape(shape).clone() for n, src, shape in w.iter_hf_sources()
                    if n.endswith("e_score_correction_bias")}}
    w.shutdown()
    return res


SCENARIOS["glm4_moe_bf16"] = scenario_glm4_moe_bf16


def scenario_moe_deterministic(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    """--deterministic-mode on the tiny Qwen3-MoE, EP 2: what the rank switched on, and the base records (whose
    MoE routing then takes megatron's deterministic index_put path)."""
    import os

    import torch

    res: dict = {}
    run_moe(rank, world, port, ckpts["qwen3_moe"], "ep2", res, layouts=("packed",), deterministic_mode=True)
    res["switches"] = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
                       os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    return res


SCENARIOS["moe_deterministic"] = scenario_moe_deterministic


def scenario_moe_grouped(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    """--moe-grouped-gemm (trainer/experts.py) on the tiny Qwen3-MoE: one rank (as moe1, with and without the aux
    loss) and, on 4 ranks, EP=2 x TP=2 with sequence parallelism; compared with SequentialMLP's records."""
    res: dict = {}
    if world == 1:
        run_moe(rank, world, port, ckpts["qwen3_moe"], "base", res, moe_grouped_gemm=True)
    else:
        run_moe(rank, world, port, ckpts["qwen3_moe"], "ep2tp2", res, layouts=("packed",), sequence_parallel=True,
                moe_grouped_gemm=True)
    return res


SCENARIOS["moe_grouped1"] = SCENARIOS["moe_grouped_ep2tp2"] = scenario_moe_grouped


def scenario_moe_grouped_layouts(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    """--moe-grouped-gemm under EP=2 x PP=2, CP=2 x EP=2 and EP=2 x TP=2 x ETP=1 (4 ranks, one after the other)."""
    res: dict = {}
    for k, name in enumerate(("ep2pp2", "cp2ep2", "ep2tp2etp1")):
        run_moe(rank, world, port + 10 * k, ckpts["qwen3_moe"], name, res,
                layouts=MOE_RUN_LAYOUTS.get(name, ("padded", "packed")), moe_grouped_gemm=True,
                **MOE_KW.get(name, {}))
    return res


SCENARIOS["moe_grouped_layouts"] = scenario_moe_grouped_layouts
