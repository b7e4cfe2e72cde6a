"""Qwen3-Next (qwen3_next) scenarios, run like trainer_scenarios.py (`python -m tests.trainer.trainer_scenarios NAME
...` finds them here), on the tiny checkpoint ckpts["qwen3_next"].

Each layout records, on the fixed batch at temperature 1, the log-probs of its DP shard, a forward-backward's stats,
the full gradient in HF names (gathered over TP), the grad norm, each layer's attention class and global number, the
model config's hybrid fields, the HF tensors weight sync would send and, at TP=2, --save-hf's folder and a model-only
--save loaded back (qwen3_next only). The qwen3_5 scenarios run the same on ckpts["qwen3_5"], the qwen3_5_moe ones on
ckpts["qwen3_5_moe"] (its experts fused in the checkpoint), with EP=2 besides (--save-hf's folder at TP=2 and EP=2);
ckpts["<family>_batch"], where given, is a saved batch with images (tests/trainer/qwen3_5_vl_ref.py) in place of
make_batch's.
"""

from __future__ import annotations

import torch

from tests.trainer.parallel_scenarios import _equiv_worker, dp_shard, record_export, record_layouts
from tests.trainer.trainer_ref import make_batch, select
from tests.trainer.trainer_scenarios import weights

# name: (tp, pp, cp); DP is what is left of the world
QWEN3_NEXT_LAYOUTS = {"base": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "cp2": (1, 1, 2), "ep2": (1, 1, 1)}
QWEN3_NEXT_EP = {"ep2": 2}  # --expert-model-parallel-size where not 1
# megatron's MoE layers under TP need sequence parallelism, which needs packed micro-batches
QWEN3_NEXT_KW = {"tp2": {"sequence_parallel": True}}
QWEN3_NEXT_RUN_LAYOUTS = {"base": ("padded", "packed"), "tp2": ("packed",), "pp2": ("padded", "packed"),
                          "cp2": ("padded", "packed"), "ep2": ("padded", "packed")}


def run_qwen3_next(rank: int, world: int, port: int, ckpt: str, name: str, res: dict, family: str = "qwen3_next",
                   round_trip: bool = True, batch_file: str | None = None) -> None:
    tp, pp, cp = QWEN3_NEXT_LAYOUTS[name]
    batch = torch.load(batch_file, weights_only=False) if batch_file else make_batch()
    ep = QWEN3_NEXT_EP.get(name, 1)
    w = _equiv_worker(rank, world, port, ckpt, tp, pp, cp, False, ep, **QWEN3_NEXT_KW.get(name, {}))
    ids = dp_shard(w, batch, name, res, w.info.ep_rank if ep > 1 else None)
    c = w.gpt.config
    res[f"{name}/config"] = (c.experimental_attention_variant, c.linear_attention_freq, c.attention_output_gate,
                             c.layernorm_zero_centered_gamma, w.gpt.rotary_pos_emb.inv_freq.numel() * 2)
    res[f"{name}/sequence_parallel"] = c.sequence_parallel
    res[f"{name}/attention_classes"] = [type(layer.self_attention).__name__ for layer in w.gpt.decoder.layers]
    res[f"{name}/layer_numbers"] = [layer.layer_number for layer in w.gpt.decoder.layers]  # global, from 1
    res[f"{name}/weights"] = weights(w)
    res[f"{name}/sources"] = {n: src.reshape(shape).clone() for n, src, shape in w.iter_hf_sources()}
    if name in ("tp2", "ep2"):  # --save-hf's gather (hf_export.py): global rank 0 writes the folder, reads it back
        record_export(w, rank, f"{family}_{port}", name, res)
        if round_trip and name == "tp2":
            record_checkpoint_round_trip(w, port, name, res)
    record_layouts(w, select(batch, ids), QWEN3_NEXT_RUN_LAYOUTS[name], name, res)
    w.shutdown()


def record_checkpoint_round_trip(w, port: int, name: str, res: dict) -> None:
    """`{name}/reloaded`: the HF tensors after a model-only --save (megatron's sharded_state_dict: GatedDeltaNet's
    in_proj and conv1d split into their q/k/v/z/b/a sections per TP rank), every parameter zeroed, and the load."""
    import shutil
    import tempfile
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from slime_rl.trainer import checkpoint as ck

    root = Path(tempfile.gettempdir(), f"slime_rl_qwen3_next_{port}_ckpt")
    path = ck.save_checkpoint(root, 1, [w.model], save_rng=False)
    with torch.no_grad():
        for p in w.gpt.parameters():
            p.zero_()
    res[f"{name}/zeroed"] = float(sum(float(t.abs().sum()) for _, t in w.iter_hf_weights()))
    ck.load_checkpoint(path, [w.model], w.optimizer, load_optim=False, load_rng=False)
    res[f"{name}/reloaded"] = weights(w)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root)


def _qwen3_next(*names: str, family: str = "qwen3_next"):
    def scenario(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
        res: dict = {}
        for k, name in enumerate(names):
            # qwen3_5's GatedDeltaNet is the same megatron module as qwen3_next's; its round trip checks its vision
            # tower's (qwen3_5_moe's is the same)
            run_qwen3_next(rank, world, port + 10 * k, ckpts[family], name, res, family,
                           round_trip=family in ("qwen3_next", "qwen3_5"), batch_file=ckpts.get(f"{family}_batch"))
        return res

    return scenario


# qwen3_5 (Qwen3.5-9B / 27B): the same hybrid decoder with a dense MLP and in_proj as four HF tensors, under the
# vision-language checkpoint's names (tiny checkpoint ckpts["qwen3_5"])
SCENARIOS = {"qwen3_next_1": _qwen3_next("base"), "qwen3_next_tp2": _qwen3_next("tp2", "pp2", "cp2"),
             "qwen3_5_1": _qwen3_next("base", family="qwen3_5"),
             "qwen3_5_tp2": _qwen3_next("tp2", "pp2", family="qwen3_5"),
             # qwen3_5_moe (Qwen3.5-35B-A3B): qwen3_5's decoder with qwen3_next's MoE block, the experts fused on disk
             "qwen3_5_moe_1": _qwen3_next("base", family="qwen3_5_moe"),
             "qwen3_5_moe_tp2": _qwen3_next("tp2", "pp2", "ep2", family="qwen3_5_moe")}
