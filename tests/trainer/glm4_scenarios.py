"""GLM-4 dense (glm4) scenarios, run like trainer_scenarios.py (`python -m tests.trainer.trainer_scenarios NAME ...`
finds them here), on the tiny checkpoint ckpts["glm4"].

Each layout records, on the fixed batch at temperature 1, the log-probs of its DP shard, a forward-backward's
stats, the full gradient in HF names (gathered over TP, stages merged by the test), the grad norm megatron's
optimizer computes, the layers' class, the HF tensors weight sync would send (iter_hf_weights and the cached
sources) and, with more than one rank, --save-hf's folder.
"""

from __future__ import annotations

from tests.trainer.parallel_scenarios import _equiv_worker, dp_shard, record_export, record_layouts
from tests.trainer.trainer_ref import make_batch, select
from tests.trainer.trainer_scenarios import weights

GLM4_LAYOUTS = {  # name: (tp, pp, cp); DP is what is left of the world
    "base": (1, 1, 1), "tp2": (2, 1, 1), "tp2sp": (2, 1, 1), "pp2": (1, 2, 1), "cp2": (1, 1, 2),
}
GLM4_KW = {"tp2sp": {"sequence_parallel": True}}  # sequence parallelism needs packed micro-batches
GLM4_RUN_LAYOUTS = {"tp2sp": ("packed",)}


def run_glm4(rank: int, world: int, port: int, ckpt: str, name: str, res: dict) -> None:
    tp, pp, cp = GLM4_LAYOUTS[name]
    batch = make_batch()
    w = _equiv_worker(rank, world, port, ckpt, tp, pp, cp, False, **GLM4_KW.get(name, {}))
    ids = dp_shard(w, batch, name, res)
    res[f"{name}/config"] = (w.gpt.config.sequence_parallel, w.gpt.config.rotary_interleaved,
                             w.gpt.config.kv_channels, w.gpt.rotary_pos_emb.inv_freq.numel() * 2)
    layers = list(w.gpt.decoder.layers)
    res[f"{name}/layer_classes"] = sorted({type(layer).__name__ for layer in layers})
    res[f"{name}/post_norm_sp"] = sorted({bool(getattr(layer.post_self_attn_layernorm.weight, "sequence_parallel",
                                                       False)) for layer in layers})
    res[f"{name}/weights"] = weights(w)
    res[f"{name}/metadata"] = w.hf_weight_metadata()
    res[f"{name}/sources"] = {n: src.reshape(shape).clone() for n, src, shape in w.iter_hf_sources()}
    if world > 1:  # --save-hf's gather (hf_export.py): global rank 0 writes the folder, reads it back
        record_export(w, rank, f"glm4_{port}", name, res)
    record_layouts(w, select(batch, ids), GLM4_RUN_LAYOUTS.get(name, ("padded", "packed")), name, res)
    w.shutdown()


def _glm4(*names: str):
    def scenario(rank: int, world: int, port: int, ckpts: dict[str, str]) -> dict:
        res: dict = {}
        for k, name in enumerate(names):
            run_glm4(rank, world, port + 10 * k, ckpts["glm4"], name, res)
        return res

    return scenario


SCENARIOS = {"glm4_1": _glm4("base"), "glm4_tp2": _glm4("tp2sp", "tp2"), "glm4_pp2cp2": _glm4("pp2", "cp2")}
