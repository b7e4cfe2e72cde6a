"""The HF checkpoint's safetensors files, read without Megatron: which file holds a tensor, whether
config.json and the weights agree (headers only), and reading tensors to CPU. Kept apart from
hf_io.py so the converters check their input before paying for the megatron import.

A family whose published checkpoints store a layer's routed experts fused (`Family.fused_experts`, Qwen3.5-MoE:
`mlp.experts.gate_up_proj` / `down_proj`, trainer/fused_experts.py) is read under the registry's per-expert names
either way: a name the files lack is sliced out of its fused tensor (only that expert's rows read), and the shape
check takes whichever form the files hold."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from slime_rl.trainer.convert import ModelArch, hf_shapes
from slime_rl.trainer.fused_experts import expert_slice, fused_shapes, fused_source, is_fused_name


def safetensors_index(checkpoint_dir: str | Path) -> dict[str, Path]:
    """HF tensor name -> the .safetensors file that holds it (single file or sharded + index)."""
    folder = Path(checkpoint_dir)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"--hf-checkpoint {folder}: neither model.safetensors nor "
                                "model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}  # safe_open is not a dict


def check_hf_weights(checkpoint_dir: str | Path, arch: ModelArch) -> None:
    """Raise ValueError naming every tensor that config.json implies but the safetensors lack, and
    every tensor whose shape differs (both shapes), reading only the file headers: a config of
    another model must fail here, not deep inside a reshape."""
    where = safetensors_index(checkpoint_dir)
    want = hf_shapes(arch)
    if arch.family.fused_experts and any(is_fused_name(n) for n in where):  # the published layout
        want = fused_shapes(want)
    missing = [n for n in want if n not in where]
    stored: dict[str, tuple[int, ...]] = {}
    by_file: dict[Path, list[str]] = {}
    for n in want:
        if n in where:
            by_file.setdefault(where[n], []).append(n)
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            stored.update({n: tuple(f.get_slice(n).get_shape()) for n in names})
    wrong = [f"{n}: safetensors {stored[n]} vs config.json {want[n]}" for n in stored if stored[n] != want[n]]
    if missing or wrong:
        raise ValueError(f"{checkpoint_dir}: the weights do not match config.json ({arch.model_type}, "
                         f"{arch.num_layers} layers, hidden {arch.hidden_size}, vocab {arch.vocab_size}): "
                         + "; ".join(([f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}"]
                                      if missing else []) + [f"shape mismatch {w}" for w in wrong[:5]])
                         + (" ..." if len(wrong) > 5 else ""))


def read_hf_tensors(checkpoint_dir: str | Path, names: list[str] | None = None,
                    missing_ok: bool = False) -> dict[str, torch.Tensor]:
    """The named tensors (all the files hold when None) from the checkpoint, on CPU, in their stored dtype; an
    expert's tensor the files hold fused is sliced out of it. `missing_ok`: a name the checkpoint has not is left
    out, else KeyError."""
    return read_indexed(safetensors_index(checkpoint_dir), names, missing_ok, where_name=checkpoint_dir)


def read_indexed(where: dict[str, Path], names: list[str] | None = None, missing_ok: bool = False,
                 where_name: str | Path = "") -> dict[str, torch.Tensor]:
    """`read_hf_tensors` of a checkpoint's `safetensors_index`."""
    names = list(where) if names is None else names
    # per file: (name asked for, stored name, expert index or None, part of the fused tensor)
    by_file: dict[Path, list[tuple[str, str, int | None, str]]] = {}
    missing = []
    for n in names:
        src = None if n in where else fused_source(n)
        if n in where:
            by_file.setdefault(where[n], []).append((n, n, None, ""))
        elif src is not None and src[0] in where:
            by_file.setdefault(where[src[0]], []).append((n, src[0], src[1], src[2]))
        else:
            missing.append(n)
    if missing and not missing_ok:
        raise KeyError(f"--hf-checkpoint {where_name}: tensors missing from the safetensors: "
                       f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    out: dict[str, torch.Tensor] = {}
    for file, items in by_file.items():
        with safe_open(file, framework="pt") as f:
            for n, stored, e, part in items:
                out[n] = f.get_tensor(n) if e is None else expert_slice(f.get_slice(stored), e, part).contiguous()
    return out
