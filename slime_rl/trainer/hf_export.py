"""The whole model as one HF folder, from a trainer of any TP x PP x DP layout.

Used by tools/convert_megatron_to_hf.py and by --save-hf during training, so both write what the
weight sync sends: every stage runs `hf_io.iter_hf_weights` (TP all-gathers, the registry's
renames, vocab padding removed), and on DP replica 0 the TP rank 0 of each later stage sends its
tensors to global rank 0 (the first stage's TP rank 0), which alone writes. A tied model's
embedding is emitted once, by stage 0 (the last stage's copy is not).

The folder is written atomically like the checkpoints: into `<out>.tmp/`, renamed to `<out>/` when
complete (an existing `<out>/` is swapped out and deleted), so a crash never leaves a folder that
looks like a finished model.

A family's checkpoint tensors the trainer does not hold (`Family.hf_passthrough`: Qwen3.5's multi-token-prediction
head `mtp.*`; its vision tower `model.visual.*` only where config.json has no vision_config, so the trainer built the
text decoder alone) are copied into the folder unchanged (their stored dtype)
from the HF folder the model came from, so that the folder loads as the whole model it was (transformers'
Qwen3_5ForConditionalGeneration); that folder must then hold the safetensors, not only config.json. A family whose
published checkpoints hold each layer's routed experts fused (`Family.fused_experts`: Qwen3.5-MoE) is written so, the
experts the trainer yields one by one stacked into `mlp.experts.gate_up_proj` / `down_proj` (trainer/fused_experts.py).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from tqdm import tqdm

from slime_rl.config.families import FAMILIES
from slime_rl.trainer.checkpoint_layout import copy_hf_metadata
from slime_rl.trainer.convert import ModelArch, hf_shapes
from slime_rl.trainer.fused_experts import fuse
from slime_rl.trainer.hf_io import hf_weight_metadata, iter_hf_weights
from slime_rl.trainer.mcore import mpu
from slime_rl.trainer.model import unwrap

TMP_SUFFIX = ".tmp"
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def hf_tensor_count(arch: ModelArch) -> int:
    """How many tensors of the trainer's the HF folder has (a tied model has no lm_head; fused experts two a layer)."""
    if arch.family.fused_experts:
        from slime_rl.trainer.convert import hf_shapes
        from slime_rl.trainer.fused_experts import fused_shapes

        return len(fused_shapes(hf_shapes(arch)))
    return sum(len(pm.hf) for pm in arch.param_maps())


def gather_hf_weights(model: torch.nn.Module, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """On global rank 0: every HF tensor of the model, stage by stage (HF order). On every other
    rank: nothing, but every rank must run the generator to its end (it runs the TP / EP all-gathers
    and the sends to rank 0). A tensor may share storage with a parameter: copy it to keep it."""
    if mpu.get_data_parallel_rank() != 0:
        # every DP replica holds the same weights, but an MoE model's experts are spread over EP
        # ranks that sit in different DP replicas: take part in the gathers, send nothing
        if arch.num_experts and (mpu.get_expert_model_parallel_world_size() > 1
                                 or mpu.get_expert_tensor_parallel_world_size() > 1):
            for _ in iter_hf_weights(model, arch):
                pass
        return
    pp_rank, pp_size = mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size()
    first_tp = mpu.get_tensor_model_parallel_rank() == 0
    if pp_size == 1:
        for name, t in iter_hf_weights(model, arch):
            if dist.get_rank() == 0:
                yield name, t
        return
    group = mpu.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    metas: list = [None] * pp_size
    if first_tp:  # rank 0's PP group: the receiver learns what each later stage will send
        dist.all_gather_object(metas, hf_weight_metadata(model, arch), group=group)
    own = iter_hf_weights(model, arch)
    if not first_tp:  # the stage's other TP ranks only take part in the all-gathers
        for _ in own:
            pass
    elif pp_rank != 0:
        for _, t in own:
            dist.send(t.contiguous(), dst=ranks[0], group=group)
    else:
        assert dist.get_rank() == ranks[0] == 0, "global rank 0 must be stage 0, TP rank 0, DP rank 0"
        yield from own
        device = next(unwrap(model).parameters()).device
        for stage in range(1, pp_size):
            for name, dtype, shape in metas[stage]:
                buf = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(buf, src=ranks[stage], group=group)
                yield name, buf


class ShardWriter:
    """Streams (name, tensor) into safetensors files of at most `max_bytes` (a bigger tensor gets a
    file of its own), then names them as HF does; one file -> model.safetensors without index."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        self.out, self.max_bytes = Path(out), max_bytes
        self.files: list[tuple[Path, list[str]]] = []
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        # own, contiguous CPU memory: safetensors refuses shared or strided storage
        self.pending[name] = tensor.detach().to("cpu", copy=True).contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        path = self.out / f"_part{len(self.files):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[Path]:
        if self.pending:
            self._flush()
        n = len(self.files)
        if n == 1:
            final = self.out / "model.safetensors"
            self.files[0][0].rename(final)
            return [final]
        weight_map, finals = {}, []
        for i, (path, names) in enumerate(self.files):
            final = self.out / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(final)
            finals.append(final)
            weight_map.update({name: final.name for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return finals


def _finish_folder(tmp: Path, hf_dir: str | Path, dtype: torch.dtype) -> None:
    """Config, tokenizer and generation config of the source folder, with the written dtype."""
    copy_hf_metadata(hf_dir, tmp)
    config = json.loads((tmp / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):  # transformers 5 writes dtype, 4 torch_dtype
        if key in config:
            config[key] = _DTYPE_NAMES[dtype]
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _fresh_tmp(out: Path) -> Path:
    """The empty `<out>.tmp/` a folder is written into before `_swap_in` (one left by an interrupted write removed)."""
    tmp = out.with_name(out.name + TMP_SUFFIX)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _swap_in(tmp: Path, out: Path) -> None:
    old = out.with_name(out.name + ".old")
    if out.exists():  # a re-save of the same path: swap, then delete the old folder
        if old.exists():
            shutil.rmtree(old)
        os.rename(out, old)
    os.rename(tmp, out)
    if old.exists():
        shutil.rmtree(old)


def passthrough_names(arch: ModelArch, hf_dir: str | Path) -> list[str]:
    """The tensors of `hf_dir`'s safetensors that the export copies through unchanged (`Family.hf_passthrough`;
    none for most families), and of a checkpoint with multi-token-prediction layers (num_nextn_predict_layers) the
    tensors of HF's layers num_layers.. that the trainer does not hold: the layers it does not build
    (ModelArch.mtp_built below mtp_layers) and a built layer's copies of the embedding and the output layer
    (DeepSeek-V3's model.layers.61.embed_tokens / shared_head.head, which SGLang's draft model never loads).
    Raises ValueError when the family has passthrough tensors and `hf_dir` holds no safetensors (the MTP leftovers
    are then left out)."""
    from slime_rl.trainer.hf_files import safetensors_index

    family = FAMILIES.get(arch.model_type)
    prefixes = family.hf_passthrough if family is not None else ()
    if family is not None and family.vision and family.text_config and arch.vision is None:
        prefixes += (family.vision_prefix,)  # Qwen3.5 without vision_config: the tower not built
    if not prefixes and not arch.mtp_layers:
        return []
    try:
        names = safetensors_index(hf_dir)
    except FileNotFoundError as e:
        if not prefixes:
            return []
        raise ValueError(f"{hf_dir}: model_type {arch.model_type!r} exports its {', '.join(p + '*' for p in prefixes)} "
                         "tensors, which the trainer does not hold, from the HF folder the model came from, and "
                         "this one has no safetensors (pass that folder)") from e
    if arch.mtp_layers:
        held = set(hf_shapes(arch))
        mtp = family.mtp_layer_prefix if family is not None else ""
        prefixes += tuple(mtp.replace("{k}", str(k)) if mtp else f"model.layers.{arch.num_layers + k}."
                          for k in range(arch.mtp_layers))
        return sorted(n for n in names if n.startswith(prefixes) and n not in held)
    return sorted(n for n in names if n.startswith(prefixes))


def _counted(tensors: Iterator[tuple[str, torch.Tensor]], bar: tqdm) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in tensors:
        bar.update(1)
        yield name, t


def save_hf_folder(model: torch.nn.Module, arch: ModelArch, out: str | Path, hf_dir: str | Path, *,
                   dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 10**9,
                   progress: bool = False) -> Path:
    """Write the model as an HF folder at `out` (atomically, see the module docstring); every rank
    of the trainer must call it, global rank 0 writes. `hf_dir`: the HF folder the model came from
    (config.json, tokenizer, generation_config are copied). `dtype`: cast to it (default: the
    model's). Returns `out`."""
    out = Path(out)
    tmp = out.with_name(out.name + TMP_SUFFIX)
    through = passthrough_names(arch, hf_dir)  # on every rank: a refusal stops them all
    writer = None
    if dist.get_rank() == 0:
        writer = ShardWriter(_fresh_tmp(out), max_shard_bytes)
    written = None
    with tqdm(total=sum(len(pm.hf) for pm in arch.param_maps()), desc="megatron->hf", unit="tensor", file=sys.stderr,
              disable=not progress or writer is None) as bar:
        tensors = gather_hf_weights(model, arch)
        if arch.family.fused_experts and writer is not None:  # each layer's experts stacked, the published layout
            tensors = fuse(_counted(tensors, bar), arch.num_experts)
        for name, t in tensors:
            assert writer is not None
            written = dtype or t.dtype
            writer.add(name, t.to(written))
            if not arch.family.fused_experts:
                bar.update(1)
    if writer is not None:
        from slime_rl.trainer.hf_files import read_hf_tensors

        # unchanged, in their stored dtype; a family without such tensors reads nothing (its hf_dir may hold
        # config.json alone, as a Megatron checkpoint's iter_*/hf/ does)
        for name, t in (read_hf_tensors(hf_dir, through) if through else {}).items():
            writer.add(name, t)
        writer.close()
        assert written is not None
        _finish_folder(tmp, hf_dir, written)
        _swap_in(tmp, out)
    dist.barrier()  # nobody reads (or writes the next) before the folder is in place
    return out


def gather_peft_state(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """A LoRA run's adapters whole under PEFT's names (CPU tensors), on global rank 0; None on the other
    ranks. Every rank calls it: the TP slices are gathered, the pipeline stages' adapters all-gathered by
    the ranks of TP and DP rank 0."""
    from slime_rl.trainer import lora

    state = lora.peft_state(lora.adapters_of(unwrap(model)), mpu.get_tensor_model_parallel_group())
    if mpu.get_tensor_model_parallel_rank() != 0 or mpu.get_data_parallel_rank() != 0:
        return None
    if mpu.get_pipeline_model_parallel_world_size() == 1:  # no stage to hear from: no pickled round trip
        return state if dist.get_rank() == 0 else None
    stages: list = [None] * mpu.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, state, group=mpu.get_pipeline_model_parallel_group())
    return {k: v for stage in stages for k, v in stage.items()} if dist.get_rank() == 0 else None


def save_peft_adapter(model: torch.nn.Module, spec, out: str | Path, hf_dir: str | Path) -> Path:  # noqa: ANN001
    """A LoRA run's adapters as a PEFT folder at `out` (adapter_config.json + adapter_model.safetensors, PEFT's
    names, whole tensors; atomic like the HF folder): every rank calls it, global rank 0 writes. `spec`:
    the run's lora.LoRASpec; `hf_dir`: the base model (adapter_config's base_model_name_or_path)."""
    from slime_rl.trainer import lora

    out = Path(out)
    tensors = gather_peft_state(model)
    if tensors is not None:
        modules = sorted(lora.peft_modules(tensors))
        tmp = _fresh_tmp(out)
        save_file(dict(sorted(tensors.items())), str(tmp / lora.PEFT_WEIGHTS), metadata={"format": "pt"})
        config = lora.peft_config(spec, modules, str(hf_dir))
        (tmp / lora.PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        _swap_in(tmp, out)
    dist.barrier()
    return out
