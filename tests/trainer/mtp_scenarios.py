"""Multi-token-prediction scenarios (tests/trainer/test_mtp.py), run like trainer_scenarios.py
(`python -m tests.trainer.trainer_scenarios NAME ...` finds them here).

"mtp1" (one rank) records, on tiny GLM-4.7-Flash with one MTP layer and the fixed batch (micro-batch size 2: two
micro-batches), a forward-backward with --enable-mtp-training (packed and padded micro-batches: its stats with the
MTP loss, the HF-named grads), the same without any MTP flag and with --mtp-num-layers alone, one train step of
each (the weights after), the weights weight sync sends, the --save-hf folder and a Megatron checkpoint read back
by fresh workers, and a checkpoint without MTP layers loaded under --mtp-num-layers. "mtp_tp2pp2" (two ranks)
records the MTP forward-backward at TP=2 (with sequence parallel, which megatron's MoE layers need under TP, and full
recompute, megatron's checkpointed MTP forward), at PP=2 and at CP=2. "mimo1" (one rank): MiMo's.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from safetensors.torch import load_file

from tests.trainer.trainer_ref import make_batch
from tests.trainer.trainer_scenarios import make_worker, weights

FACTOR = 0.5  # --mtp-loss-scaling-factor (slime's default 0.2 would do; any value the test can tell apart)
MTP = {"mtp_num_layers": 1, "enable_mtp_training": True, "mtp_loss_scaling_factor": FACTOR}


def _fb(w, batch: dict, res: dict, key: str) -> None:
    """Log-probs, a forward-backward's stats and the HF-named grads of the trained parameters (frozen MTP layers have
    none; under CP the distributed optimizer's shards gathered whole, as trainer_scenarios.hf_grads does)."""
    from slime_rl.trainer.hf_io import iter_hf_tensors
    from tests.trainer.trainer_scenarios import _gather_dp_grad_shards

    logp = w.compute_logprobs(batch)
    res[f"{key}/logp"] = logp
    res[f"{key}/stats"] = w.forward_backward(batch, logp)
    if w.dp_size * w.info.cp_size > 1:
        _gather_dp_grad_shards(w)
    res[f"{key}/grad"] = {n: t.clone() for n, t in iter_hf_tensors(w.gpt, w.arch, lambda p: p.main_grad.detach(),
                                                                   skip_frozen=True)}


def scenario_mtp1(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    batch, res, ckpt = make_batch(), {}, ckpts["glm4_moe_lite_mtp"]
    tmp = Path(tempfile.mkdtemp(prefix="slime_rl_mtp_"))
    w = make_worker(rank, world, port, ckpt, **MTP)
    port += 1
    res["sent"] = [n for n, _, _ in w.hf_weight_metadata()]
    res["initial"] = weights(w)
    _fb(w, batch, res, "train/packed")
    w.micro = dataclasses.replace(w.micro, pack_sequences=False)
    _fb(w, batch, res, "train/padded")
    w.micro = dataclasses.replace(w.micro, pack_sequences=True)
    res["train/metrics"] = w.train_step(batch)
    res["train/after"] = weights(w)
    w.save_hf(str(tmp / "hf"))
    res["exported"] = {k: v.clone() for f in sorted((tmp / "hf").glob("*.safetensors"))
                       for k, v in load_file(f).items()}
    w.save_checkpoint(str(tmp / "ckpt"), 1, {})
    w.shutdown()
    # the exported folder as a checkpoint of its own, and the Megatron checkpoint resumed
    w = make_worker(rank, world, port, str(tmp / "hf"), **MTP)
    port += 1
    res["reloaded_hf"] = weights(w)
    w.shutdown()
    w = make_worker(rank, world, port, ckpt, **MTP)
    port += 1
    w.load_latest_checkpoint(str(tmp / "ckpt"))
    res["resumed"] = weights(w)
    w.shutdown()
    for key, kw in (("none", {}), ("frozen", {"mtp_num_layers": 1})):
        w = make_worker(rank, world, port, ckpt, **kw)
        port += 1
        res[f"{key}/sent"] = [n for n, _, _ in w.hf_weight_metadata()]
        _fb(w, batch, res, f"{key}/packed")
        res[f"{key}/metrics"] = w.train_step(batch)
        res[f"{key}/after"] = weights(w)
        if key == "none":
            w.save_checkpoint(str(tmp / "ckpt_none"), 1, {})
        w.shutdown()
    # a checkpoint without MTP layers (a --ref-load or --load converted without them) under --mtp-num-layers
    w = make_worker(rank, world, port, ckpt, **MTP)
    w.load_latest_checkpoint(str(tmp / "ckpt_none"))
    res["mtp_from_plain"] = weights(w)
    w.shutdown()
    return res


def _cp2_worker(rank: int, world: int, port: int, ckpt: str):
    from slime_rl.config.groups import (
        AlgoConfig,
        BatchConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelConfig,
        TrainerConfig,
    )
    from slime_rl.trainer.worker import TrainerWorker

    return TrainerWorker(rank, world, "127.0.0.1", port,
                         ParallelConfig(context_parallel_size=2, actor_num_gpus_per_node=world),
                         BatchConfig(micro_batch_size=2, global_batch_size=4),
                         OptimizerConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.0, lr_decay_style="constant"),
                         ModelConfig(hf_checkpoint=ckpt), AlgoConfig(), train_iters=10, trainer=TrainerConfig(**MTP))


def scenario_mtp_tp2pp2(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    batch, res, ckpt = make_batch(), {}, ckpts["glm4_moe_lite_mtp"]
    for key in ("tp2", "pp2", "cp2"):
        if key == "cp2":  # each sample split over the two ranks in megatron's 2 x CP chunks
            w = _cp2_worker(rank, world, port, ckpt)
        else:  # megatron's MoE layers under TP need sequence parallel; TP=2 recomputes too, as slime's GLM script
            tp2 = {"tp": 2, "sequence_parallel": True, "recompute_granularity": "full", "recompute_method": "uniform",
                   "recompute_num_layers": 1}
            w = make_worker(rank, world, port, ckpt, **(tp2 if key == "tp2" else {"pp": 2}), **MTP)
        port += 1
        _fb(w, batch, res, key)
        w.shutdown()
    return res


def scenario_mimo1(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
    """MiMo (Qwen2's decoder, MiMo's MTP names): a forward-backward, the sent names, the checkpoint's tensors as
    loaded and sent, and --save-hf after a step."""
    batch, res = make_batch(), {}
    w = make_worker(rank, world, port, ckpts["mimo_mtp"], **MTP)
    res["sent"] = [n for n, _, _ in w.hf_weight_metadata()]
    res["initial"] = {n: src.reshape(shape).clone() for n, src, shape in w.iter_hf_sources()}
    res["exported_initial"] = load_file(Path(ckpts["mimo_mtp"]) / "model.safetensors")
    _fb(w, batch, res, "train/packed")
    w.train_step(batch)
    res["after"] = weights(w)
    out = Path(tempfile.mkdtemp(prefix="slime_rl_mimo_")) / "hf"
    w.save_hf(str(out))
    res["exported"] = {k: v.clone() for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    w.shutdown()
    return res


SCENARIOS = {"mtp1": scenario_mtp1, "mtp_tp2pp2": scenario_mtp_tp2pp2, "mimo1": scenario_mimo1}
