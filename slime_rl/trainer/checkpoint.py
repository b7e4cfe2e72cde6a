"""Megatron distributed checkpoints (torch_dist) of the trainer: model, optimizer, LR schedule, RNG.

The files and their completeness rules are in checkpoint_layout.py (re-exported here); this
module saves and loads the state, atomically (see there).

What is in the checkpoint (all through one `dist_checkpointing.save` call):
  * model: the GPTModel's `sharded_state_dict` (reshards on load: a TP=2 save loads at TP=1);
  * optimizer: the DistributedOptimizer's `sharded_state_dict` in the `dp_reshardable` format by
    default (Megatron-LM's default: fully parallel, no gathering; reshards over DP only), or
    `fully_reshardable` (gathered per DP group; reshards over TP/PP too) when asked;
  * lr_scheduler: OptimizerParamScheduler.state_dict() (common state, written by rank 0);
  * rng_state: python / numpy / torch CPU / CUDA generators and Megatron's RNG tracker states,
    one ShardedObject per rank at (pp, tp, dp); restored only when the layout is the same;
  * extra: a JSON-able dict of the caller's (rollout step, data-source position, ...), kept in the
    marker so that orchestration code can read it without megatron (`read_checkpoint_info`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from slime_rl.trainer import lora
from slime_rl.trainer.checkpoint_layout import (  # noqa: F401  (re-exported: the public checkpoint API)
    DIST_CKPT_METADATA,
    HF_SUBDIR,
    MARKER_FILE,
    TMP_SUFFIX,
    TRACKER_FILE,
    CheckpointInfo,
    copy_hf_metadata,
    disk_problem,
    is_complete,
    is_megatron_checkpoint,
    iter_dir,
    keep_last,
    latest_checkpoint,
    read_checkpoint_info,
    resolve_checkpoint,
    write_atomic,
)
from slime_rl.trainer.mcore import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    dist_checkpointing,
    mpu,
    tensor_parallel,
)
from slime_rl.trainer.model import unwrap

logger = logging.getLogger(__name__)

# vision_model: VL (vision.py); mtp: the multi-token-prediction block (model.py)
_MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.", "vision_model.", "mtp.")
OPTIM_SHARDINGS = ("dp_reshardable", "fully_reshardable")


# ---- state
def _topology() -> dict[str, int]:
    return {"world": dist.get_world_size(), "tp": mpu.get_tensor_model_parallel_world_size(),
            "pp": mpu.get_pipeline_model_parallel_world_size(), "dp": mpu.get_data_parallel_world_size()}


def _single_chunk(model_chunks: list[torch.nn.Module] | torch.nn.Module) -> torch.nn.Module:
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    if len(chunks) != 1:
        raise NotImplementedError(f"{len(chunks)} model chunks: virtual pipeline parallelism is not supported "
                                  "by the trainer yet (one chunk per rank)")
    return unwrap(chunks[0])


def _sharding_metadata(optim_sharding: str) -> dict[str, Any]:
    """The metadata megatron's sharded_state_dict methods read (as Megatron-LM 0.19 builds it)."""
    return {"distrib_optim_sharding_type": optim_sharding, "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True,
            "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}


def _rng_sharded_object(state: Any) -> Any:
    """One object per (pp, tp, dp) rank: every rank's generators differ (TP offsets the seed)."""
    shape = (mpu.get_pipeline_model_parallel_world_size(), mpu.get_tensor_model_parallel_world_size(),
             mpu.get_data_parallel_world_size())
    offset = (mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank(),
              mpu.get_data_parallel_rank())
    return ShardedObject("rng_state", state, shape, offset, replica_id=0)


def get_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        # clone: the tracker hands out its live tensors, which later forks mutate
        "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The megatron optimizers under a ChainedOptimizer (or the one given)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _ensure_optimizer_state(optimizer: Any) -> None:
    """Give a fresh optimizer dummy Adam state before loading into it.

    Without apex / TransformerEngine (our CPU path), megatron 0.19's DistributedOptimizer.state_dict
    reads torch Adam's per-param `step`, which exists only after a first step, and it is called by
    sharded_state_dict(is_loading=True); the loaded values overwrite the dummies."""
    for opt in _inner_optimizers(optimizer):
        inner = opt.optimizer
        if len(inner.state) != 0:
            continue
        if hasattr(inner, "dummy_step"):  # megatron-core's HybridDeviceOptimizer (--optimizer-cpu-offload)
            # makes its sub-optimizers' states with one step on random gradients, as megatron's own load
            # does: the loaded weights, main params and states overwrite what it changed
            inner.dummy_step()
            continue
        if getattr(opt, "init_state_fn", None) is None:
            raise NotImplementedError(f"loading optimizer state into a fresh {type(inner).__name__}: "
                                      "only optimizers with an init_state_fn (adam) are supported")
        opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.tensor(0.0))


def _restore_adam_steps(optimizer: Any) -> None:
    """Set torch Adam's per-param `step` from the loaded param groups.

    megatron 0.19's non-TE load path (torch Adam keeps `step` as a per-param tensor) puts the saved
    step into param_groups and the state, then `_set_main_param_and_optimizer_states` copies the
    PRE-load step tensor back over it (the dp_reshardable format carries `step` as a
    LocalNonpersistentObject of the current state): a resumed run would restart Adam's bias
    correction. It also makes all params share one step tensor, which Adam increments in place
    once per param. Each param gets its own tensor with the group's loaded step. (With TE's
    FusedAdam the step lives only in param_groups and nothing here applies.)"""
    for opt in _inner_optimizers(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                s = inner.state.get(p, {})
                if isinstance(s.get("step"), torch.Tensor):
                    s["step"] = torch.tensor(float(group["step"]), dtype=s["step"].dtype, device=s["step"].device)


def _model_global_shapes(sharded: Any) -> dict[str, tuple[int, ...]]:
    """key -> global shape of every ShardedTensor in a model's sharded state dict (factories, e.g.
    the SwiGLU fc1 split, are built to see their tensors)."""
    out: dict[str, tuple[int, ...]] = {}

    def visit(x: Any) -> None:
        if isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)
        elif isinstance(x, ShardedTensorFactory):
            visit(x.build())
        elif isinstance(x, ShardedTensor):
            out[x.key] = tuple(x.global_shape)

    visit(sharded)
    return out


def checkpoint_model_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Global shapes of the model tensors of a checkpoint folder (e.g. the padded vocab of
    `embedding.word_embeddings.weight`), read from its metadata without loading anything."""
    meta = dist_checkpointing.load_tensors_metadata(str(path))
    return {k: tuple(v.global_shape) for k, v in meta.items()
            if k.startswith(_MODEL_KEY_PREFIXES) and hasattr(v, "global_shape")}


def checkpoint_model_dtype(path: str | Path) -> torch.dtype:
    """The dtype of the checkpoint's word embedding (the dtype its model was trained in)."""
    return dist_checkpointing.load_tensors_metadata(str(path))["embedding.word_embeddings.weight"].dtype


def check_model_matches(path: str | Path, model_sharded: Any) -> None:
    """Raise ValueError naming every missing, unexpected and mis-shaped model tensor when the
    model (built from an HF config) does not match the checkpoint's weights; dist_checkpointing's
    own errors for these cases do not name the tensor. With PP each stage holds part of the keys:
    the check runs on their union over the PP group (every rank of the group must call it)."""
    ckpt = checkpoint_model_shapes(path)
    model = _model_global_shapes(model_sharded)
    if mpu.model_parallel_is_initialized() and mpu.get_pipeline_model_parallel_world_size() > 1:
        stages: list = [None] * mpu.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, model, group=mpu.get_pipeline_model_parallel_group())
        model = {k: v for stage in stages for k, v in stage.items()}
    missing = sorted(set(model) - set(ckpt))
    unexpected = sorted(set(ckpt) - set(model))
    shapes = [f"{k}: checkpoint {ckpt[k]} vs model {model[k]}" for k in sorted(set(ckpt) & set(model))
              if ckpt[k] != model[k]]
    if missing or unexpected or shapes:
        raise ValueError(f"{path}: the checkpoint's weights do not match the model built from the HF config "
                         f"(another model's config, or another vocab padding?): missing in the checkpoint "
                         f"{missing}; not in the model {unexpected}; shape mismatches {shapes}")


def _check_json(extra: dict[str, Any]) -> None:
    for k, v in extra.items():
        try:
            json.dumps(v)
        except TypeError as e:
            raise TypeError(f"save_checkpoint: extra[{k!r}] is not JSON-serializable ({e})") from e


def _barrier() -> None:
    dist.barrier()


# ---- save / load
def save_checkpoint(root: str | Path, step: int, model_chunks: list[torch.nn.Module] | torch.nn.Module,
                    optimizer: Any = None, scheduler: Any = None, extra: dict[str, Any] | None = None, *,
                    save_rng: bool = True, optim_sharding: str = "dp_reshardable",
                    hf_dir: str | Path | None = None) -> Path:
    """Save `<root>/iter_<step>/` atomically; every rank must call it. Returns the folder.

    `model_chunks`: the trainer's model(s) (DDP / Float16Module wrappers are unwrapped).
    `optimizer`: megatron's (Distributed)Optimizer or None (model-only, e.g. the HF converter).
    `extra`: JSON-able state of the caller, returned by `load_checkpoint`.
    `hf_dir`: the HF folder the model came from; its config and tokenizer files are copied into
    `<iter>/hf/` so that the checkpoint can be exported to HF without the original folder."""
    if optim_sharding not in OPTIM_SHARDINGS:
        raise ValueError(f"optim_sharding={optim_sharding!r}: one of {OPTIM_SHARDINGS}")
    extra = dict(extra or {})
    _check_json(extra)
    root = Path(root)
    final = iter_dir(root, step)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    rank = dist.get_rank()
    try:
        return _save(root, step, final, tmp, rank, model_chunks, optimizer, scheduler, extra, save_rng,
                     optim_sharding, hf_dir)
    # torch's CheckpointException, which carries the writers' failures, derives from BaseException
    except BaseException as exc:  # the partial folder stays until every rank has stopped (train.py removes it)
        problem = None if isinstance(exc, (KeyboardInterrupt, SystemExit)) else disk_problem(root, exc)
        if problem is None:
            raise
        raise CheckpointDiskError(f"saving {final.name} into {root}: {problem} ({type(exc).__name__}: "
                                  f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''})") from exc


class CheckpointDiskError(OSError):
    """A save failed because of its disk (full, over quota, read-only): named as such, with the free space."""


def _save(root: Path, step: int, final: Path, tmp: Path, rank: int, model_chunks: Any, optimizer: Any,
          scheduler: Any, extra: dict[str, Any], save_rng: bool, optim_sharding: str,
          hf_dir: str | Path | None) -> Path:
    t0 = time.perf_counter()
    if rank == 0:
        if tmp.exists():  # an earlier save of this step was interrupted
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()

    gpt = _single_chunk(model_chunks)
    metadata = _sharding_metadata(optim_sharding)
    state: dict[str, Any] = {"model": gpt.sharded_state_dict(metadata=metadata)}
    contents = ["model"]
    if optimizer is not None:
        # the optimizer finds each param's checkpoint key through the model's sharded state dict
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=False, metadata=metadata)
        contents.append("optimizer")
    if scheduler is not None:
        state["lr_scheduler"] = scheduler.state_dict()
        contents.append("lr_scheduler")
    if save_rng:
        state["rng_state"] = _rng_sharded_object(get_rng_state())
        contents.append("rng_state")
    content_metadata = {k: v for k, v in metadata.items() if k != "dp_cp_group"}  # no process groups on disk
    dist_checkpointing.save(state, str(tmp), content_metadata=content_metadata)
    _barrier()  # every rank's shards are on disk

    if rank == 0:
        if hf_dir is not None:  # after dist_checkpointing.save, which warns about a non-empty folder
            copy_hf_metadata(hf_dir, tmp / HF_SUBDIR)
        marker = {"step": step, "extra": extra, "contents": contents, "topology": _topology(),
                  "optim_sharding": optim_sharding if optimizer is not None else None,
                  "saved_at": time.time()}
        write_atomic(tmp / MARKER_FILE, json.dumps(marker, indent=2))
        old = final.with_name(final.name + ".old")
        if final.exists():  # re-saving a step (e.g. after a resume): swap, then delete the old one
            if old.exists():
                shutil.rmtree(old)
            os.rename(final, old)
        os.rename(tmp, final)
        write_atomic(root / TRACKER_FILE, str(step))
        if old.exists():
            shutil.rmtree(old)
        logger.info("saved checkpoint %s in %.1f s", final, time.perf_counter() - t0)
    _barrier()  # no rank returns (and, e.g., prunes or loads) before the rename
    return final


def load_checkpoint(path: str | Path, model_chunks: list[torch.nn.Module] | torch.nn.Module,
                    optimizer: Any = None, scheduler: Any = None, *, load_optim: bool | None = None,
                    load_rng: bool = True) -> dict[str, Any]:
    """Load a checkpoint folder (or the latest complete one under a root) into the model and,
    when given, the optimizer and scheduler; every rank must call it. Returns the saved `extra`.

    `load_optim`: None loads the optimizer state when the checkpoint has it; False never (then
    the optimizer's fp32 main params are refreshed from the loaded weights, and the LR schedule is
    not loaded either); True requires it.
    RNG states are restored only when the parallel layout is the one saved (they are per rank)."""
    where = resolve_checkpoint(path)
    if (where / MARKER_FILE).is_file():
        info = read_checkpoint_info(where)
    else:  # a dist_checkpointing folder of another writer (e.g. Megatron-LM): its model only
        logger.warning("%s: no %s; loading the model weights only", where, MARKER_FILE)
        info = CheckpointInfo(path=where, step=0, extra={}, contents=("model",))
    has_optim = "optimizer" in info.contents
    if load_optim and not has_optim:
        raise ValueError(f"{where}: the checkpoint has no optimizer state (model-only, e.g. converted from HF)")
    do_optim = optimizer is not None and has_optim and load_optim is not False
    topo = _topology()
    same_layout = all(info.topology.get(k) == topo[k] for k in ("tp", "pp", "dp"))
    sharding = info.optim_sharding or "dp_reshardable"
    if do_optim and sharding == "dp_reshardable" and not all(
            info.topology.get(k) == topo[k] for k in ("tp", "pp")):
        raise ValueError(f"{where}: the optimizer state was saved at TP={info.topology.get('tp')} "
                         f"PP={info.topology.get('pp')} in the dp_reshardable format, which reshards over DP only; "
                         f"this run has TP={topo['tp']} PP={topo['pp']} (load the model only with "
                         "load_optim=False, or save with optim_sharding='fully_reshardable')")

    gpt = _single_chunk(model_chunks)
    metadata = _sharding_metadata(sharding)
    state: dict[str, Any] = {"model": gpt.sharded_state_dict(metadata=metadata)}
    adapters = sorted(k for k in state["model"] if lora.is_adapter_name(k))
    base_only = bool(adapters) and not any(lora.is_adapter_name(k) for k in checkpoint_model_shapes(where))
    if base_only:  # a LoRA run from a checkpoint without adapters (the base's): the adapters keep their start
        logger.warning("%s: no LoRA adapters in the checkpoint; loading the base weights, adapters as initialised "
                       "(the optimizer state, if any, is of other parameters and is not loaded)", where)
        state["model"] = {k: v for k, v in state["model"].items() if k not in adapters}
        do_optim = False
    mtp = sorted(k for k in state["model"] if k.startswith("mtp."))
    without_mtp = bool(mtp) and not any(k.startswith("mtp.") for k in checkpoint_model_shapes(where))
    if without_mtp:  # --mtp-num-layers from a checkpoint without them (a --ref-load converted without MTP layers)
        logger.warning("%s: no multi-token-prediction layers in the checkpoint; loading the rest, the MTP layers as "
                       "the HF checkpoint has them (the optimizer state, if any, is of other parameters and is not "
                       "loaded)", where)
        state["model"] = {k: v for k, v in state["model"].items() if k not in mtp}
        do_optim = False
    check_model_matches(where, state["model"])
    if do_optim:
        _ensure_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=metadata)
    do_rng = load_rng and same_layout and "rng_state" in info.contents
    if do_rng:
        state["rng_state"] = _rng_sharded_object(None)
    elif load_rng and "rng_state" in info.contents:
        logger.warning("%s: saved at %s, running at %s: RNG states not restored", where, info.topology, topo)
    loaded = dist_checkpointing.load(state, str(where))

    missing = gpt.load_state_dict(loaded["model"], strict=not (base_only or without_mtp)).missing_keys
    if any(not (base_only and lora.is_adapter_name(k)) and not (without_mtp and k.startswith("mtp.")) for k in missing):
        raise ValueError(f"{where}: weights missing from the loaded state: {missing}")
    if do_optim:
        # no_grad: in fp32 the optimizer's main params are views of the (requires_grad) model
        # params, and megatron copies into them in place
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer)
    elif optimizer is not None:
        # the optimizer keeps its own fp32 copy (bf16) / shard views: point them at the new weights
        with torch.no_grad():
            optimizer.reload_model_params()
    # the schedule belongs with the optimizer state: a finetune from model weights starts it afresh
    if scheduler is not None and "lr_scheduler" in loaded and load_optim is not False and not (base_only or
                                                                                                without_mtp):
        scheduler.load_state_dict(loaded["lr_scheduler"])
    if do_rng:
        set_rng_state(loaded["rng_state"])
    _barrier()
    return dict(info.extra)
