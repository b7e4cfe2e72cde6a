"""Which HF linears LoRA adapts, and PEFT's files: what the trainer (trainer/lora.py) and the checks before
launch (preflight) both read, importable without Megatron.

PEFT's target_modules match module names by their last part (q_proj, ...); `all-linear` here is every
attention and MLP linear of the decoder layers, less MoE routers and routed experts (refused when named:
LoRA on routed experts is not built) and the linears of a layout the adapters do not cover (multi-latent
attention's down projections, GLM-4's one-tensor gate_up_proj: refused when named). An adapter folder is
PEFT's: adapter_config.json (peft_type LORA, r, lora_alpha, lora_dropout, target_modules) and
adapter_model.safetensors with
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r].
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from slime_rl.config.families import Layout, ParamMap

ALL_LINEAR = "all-linear"
COLUMN_LAYOUTS = (Layout.QKV, Layout.FC1, Layout.COLUMN)
_ADAPTED_LAYOUTS = (*COLUMN_LAYOUTS, Layout.ROW)
ADAPTER_MARK = ".lora."  # in the Megatron name of every adapter parameter (…linear_qkv.lora.A.q_proj)


@dataclass(frozen=True)
class LoRASpec:
    """--lora-rank, --lora-alpha, --lora-dropout, --lora-target-modules (PEFT's names)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = (ALL_LINEAR,)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def is_adapter_name(name: str) -> bool:
    return ADAPTER_MARK in name


def hf_module(hf_weight_name: str) -> str:
    """model.layers.3.self_attn.q_proj.weight -> model.layers.3.self_attn.q_proj"""
    return hf_weight_name.rsplit(".", 1)[0]


def short_name(hf_weight_name: str) -> str:
    """model.layers.3.self_attn.q_proj.weight -> q_proj (PEFT's target_modules match module names' ends)"""
    return hf_module(hf_weight_name).rsplit(".", 1)[-1]


def adaptable(pm: ParamMap) -> bool:
    """A linear's weight whose layout the adapters handle (not a router, a norm, an embedding, a buffer)."""
    return pm.mcore.endswith(".weight") and pm.layout in _ADAPTED_LAYOUTS and not pm.buffer


def choose(maps: Iterable[ParamMap], targets: tuple[str, ...], check: bool = True) -> dict[str, tuple[bool, ...]]:
    """Which HF linears of these layer entries the targets adapt: {megatron name: one flag per HF part}.
    `check` (the whole model's entries): ValueError naming the target when it adapts nothing there, or names a
    routed expert's linear (LoRA on routed experts is not built) or a linear of another layout (MLA's down
    projections)."""
    maps = [pm for pm in maps if pm.mcore.endswith(".weight") and not pm.buffer]
    names = {short_name(h) for pm in maps for h in pm.hf}
    every = ALL_LINEAR in targets
    for t in targets if check else ():  # check=False: one pipeline stage's layers, which may lack a target
        if t == ALL_LINEAR:
            continue
        if t not in names:
            raise ValueError(f"--lora-target-modules {t}: no linear of this model is named so (its linears: "
                             f"{', '.join(sorted(names))}, or all-linear)")
        hits = [pm for pm in maps if any(short_name(h) == t for h in pm.hf)]
        if all(pm.expert for pm in hits):
            raise ValueError(f"--lora-target-modules {t}: only the routed experts have it, and LoRA on routed "
                             "experts is not built; target the attention (q_proj,k_proj,v_proj,o_proj) and "
                             "any shared or dense MLP")
        if any(not adaptable(pm) and not pm.expert for pm in hits):
            raise ValueError(f"--lora-target-modules {t}: a linear of a layout the adapters do not cover "
                             "(multi-latent attention's down projections, GLM-4's one-tensor gate_up_proj); leave it "
                             "out")
    out = {}
    for pm in maps:
        if pm.expert or not adaptable(pm):
            continue
        flags = tuple(every or short_name(h) in targets for h in pm.hf)
        if any(flags):
            out[pm.mcore] = flags
    return out


_LAYER = re.compile(r"\.(\d+)\.")


def peft_target_regex(modules: Iterable[str]) -> str:
    """PEFT's target_modules as one regex matched against full module names: exactly the adapted HF
    linears (any layer index), so a vision tower's linears of the same short name stay untouched."""
    shapes = sorted({_LAYER.sub(".#.", m, count=1) for m in modules})
    return "^(" + "|".join(re.escape(s).replace(r"\#", r"\d+").replace("#", r"\d+") for s in shapes) + ")$"


# ---- PEFT's files
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def peft_config(spec: LoRASpec, modules: Iterable[str], base_model: str) -> dict:
    """adapter_config.json for PEFT's LoraConfig (target_modules: `peft_target_regex` of the adapted modules)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": peft_target_regex(modules), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
            "inference_mode": True}


def sglang_adapter_config(spec: LoRASpec, modules: Iterable[str], base_model: str) -> dict:
    """`peft_config` as SGLang's /load_lora_adapter_from_tensors takes it: target_modules the adapted modules'
    short names (its LoRAConfig refuses a regex string: only a list of names, or all-linear)."""
    return {**peft_config(spec, modules, base_model), "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules})}


def read_peft_config(folder: str) -> dict:
    """adapter_config.json of a PEFT adapter folder; ValueError naming the file when the folder is not one this
    trainer can start from (a file missing, another PEFT type, rsLoRA, DoRA, biases)."""
    root = Path(folder)
    cfg_path, weights = root / PEFT_CONFIG, root / PEFT_WEIGHTS
    for path in (cfg_path, weights):
        if not path.is_file():
            raise ValueError(f"--lora-load {folder}: no {path.name} (a PEFT adapter folder holds "
                             f"{PEFT_CONFIG} and {PEFT_WEIGHTS})")
    cfg = json.loads(cfg_path.read_text())
    for key, want in (("peft_type", "LORA"), ("use_rslora", False), ("use_dora", False), ("bias", "none")):
        if cfg.get(key, want) != want:
            raise ValueError(f"--lora-load {cfg_path}: {key} is {cfg.get(key)!r}; only plain LoRA ({key} "
                             f"{want!r}) is trained here")
    return cfg


def read_peft_folder(folder: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors) of a PEFT adapter folder (`read_peft_config`'s checks)."""
    from safetensors.torch import load_file

    return read_peft_config(folder), load_file(str(Path(folder) / PEFT_WEIGHTS))


def peft_key(module: str, which: str) -> str:
    """PEFT's name of an adapter tensor (which: "A" or "B") of an HF module."""
    return f"base_model.model.{module}.lora_{which}.weight"


def peft_modules(tensors: Iterable[str]) -> set[str]:
    """The HF modules an adapter file's tensors adapt."""
    return {k.removeprefix("base_model.model.").split(".lora_")[0] for k in tensors}


def run_rank_and_targets(rank: int, targets: Iterable[str], load: str | None) -> tuple[int, tuple[str, ...]]:
    """A run's adapter rank and targets: --lora-load's (the r of its adapter_config.json, the modules its
    tensors adapt: what the trainer will train), else --lora-rank and --lora-target-modules; a --lora-load
    folder that cannot be read here counts with the flags (rank 0: unknown, when --lora-rank is not given)."""
    if load:
        try:
            spec = spec_of_folder(load)
            return spec.rank, tuple(spec.targets)
        except (OSError, ValueError, KeyError):
            pass  # not here: the flags'
    return rank, tuple(targets)


def spec_of_folder(folder: str) -> LoRASpec:
    """The LoRASpec of a PEFT folder (--lora-load): its r, lora_alpha and dropout, the modules its tensors adapt
    (their names read from the file's header, no tensor loaded)."""
    from safetensors import safe_open

    cfg = read_peft_config(folder)
    with safe_open(str(Path(folder) / PEFT_WEIGHTS), framework="pt") as f:
        modules = peft_modules(f.keys())
    return spec_from_record({**cfg, "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules})})


CHECKPOINT_KEY = "lora"  # a LoRA run's checkpoint keeps `spec_record` under this key of its marker's extra


def spec_record(spec: LoRASpec) -> dict:
    """The JSON a checkpoint keeps of its adapters (PEFT's keys)."""
    return {"r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": list(spec.targets)}


def spec_from_record(record: dict) -> LoRASpec:
    """The LoRASpec of PEFT's keys (a checkpoint's record, an adapter_config.json with its targets); an absent
    lora_alpha is PEFT's default, 8."""
    return LoRASpec(rank=int(record["r"]), alpha=float(record.get("lora_alpha", 8)),
                    dropout=float(record.get("lora_dropout") or 0.0), targets=tuple(record["target_modules"]))
