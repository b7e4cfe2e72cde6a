"""The HF checkpoint's safetensors files, read without Megatron: which file holds a tensor, whether
config.json and the weights agree (headers only), and reading tensors to CPU. Kept apart from
hf_io.py so the converters check their input before paying for the megatron import."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from slime_rl.trainer.convert import ModelArch, hf_shapes


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


def read_hf_tensors(checkpoint_dir: str | Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The named tensors (all when None) from the checkpoint, on CPU, in their stored dtype."""
    where = safetensors_index(checkpoint_dir)
    names = list(where) if names is None else names
    missing = [n for n in names if n not in where]
    if missing:
        raise KeyError(f"--hf-checkpoint {checkpoint_dir}: tensors missing from the safetensors: "
                       f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(where[n], []).append(n)
    for file, file_names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for n in file_names:
                out[n] = f.get_tensor(n)
    return out
