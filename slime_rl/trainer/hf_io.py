"""HF safetensors <-> this rank's Megatron parameters.

`load_hf_weights` reads only the tensors this rank needs (safetensors opens lazily) and copies its
TP shard of each into the model. `iter_hf_weights` is the inverse used by weight sync: every TP
rank all-gathers each parameter over the TP group and every rank of a pipeline stage yields the
same full HF tensors, in a fixed order (so all ranks run the same collectives). `iter_hf_sources`
is what weight sync sends: the same tensors, at TP=1 as views of the parameters cached per model.

Pipeline parallelism: stage p of P owns layers [p * n / P, (p + 1) * n / P), which megatron names
from 0 on every stage, so `stage_param_maps` pairs each local name with the global HF names.
Stage 0 holds the embedding, the last stage the final norm and the output layer. A tied model
with P > 1 keeps a second copy of the word embeddings on the last stage as `output_layer.weight`
(megatron all-reduces the two copies' grads, so they stay equal): it is loaded from
model.embed_tokens.weight but never emitted, so the HF name is yielded once, by stage 0.

Mixture of experts: expert-parallel rank r of E holds experts [r * n / E, (r + 1) * n / E), named
from 0 locally (config/families.py), each split over the expert-tensor-parallel group (ETP, not TP).
`iter_hf_weights` gathers each local expert over ETP, then over EP, and yields every expert of the
layer under its global HF name, in expert order, on every rank (so weight sync, which runs on one
rank per stage, and the HF export see the whole model).
"""

from __future__ import annotations

import functools
import itertools
import re
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from slime_rl.trainer import lora
from slime_rl.trainer.convert import Layout, ModelArch, ParamMap, hf_to_mcore_shard, mcore_shards_to_hf
from slime_rl.trainer.convert.shards import COPIED_AT_TP1, mcore_param_to_hf_views
from slime_rl.trainer.hf_files import check_hf_weights, read_hf_tensors
from slime_rl.trainer.mcore import mpu
from slime_rl.trainer.model import unwrap


def _tp() -> tuple[int, int, dist.ProcessGroup | None]:
    if not mpu.model_parallel_is_initialized():
        return 0, 1, None
    return (mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size(),
            mpu.get_tensor_model_parallel_group())


def _pp() -> tuple[int, int]:
    if not mpu.model_parallel_is_initialized():
        return 0, 1
    return mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size()


def _ep() -> tuple[int, int, dist.ProcessGroup | None]:
    if not mpu.model_parallel_is_initialized():
        return 0, 1, None
    return (mpu.get_expert_model_parallel_rank(), mpu.get_expert_model_parallel_world_size(),
            mpu.get_expert_model_parallel_group())


def _etp() -> tuple[int, int, dist.ProcessGroup | None]:
    if not mpu.model_parallel_is_initialized():
        return 0, 1, None
    return (mpu.get_expert_tensor_parallel_rank(), mpu.get_expert_tensor_parallel_world_size(),
            mpu.get_expert_tensor_parallel_group())


def _split(pm: ParamMap) -> tuple[int, int, dist.ProcessGroup | None]:
    """(rank, size, group) of the group a parameter is split over: ETP for experts, else TP."""
    return _etp() if pm.expert else _tp()


def registry_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers the registry names (ParamMap.buffer: a router's expert_bias), by Megatron name."""
    return {n: b for n, b in unwrap(model).named_buffers() if n.endswith(".router.expert_bias")}


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and its registry buffers, by Megatron name (LoRA adapters are not HF tensors:
    they merge into the weights they adapt, trainer/lora.py)."""
    params = {n: p for n, p in unwrap(model).named_parameters() if not lora.is_adapter_name(n)}
    return {**params, **registry_buffers(model)}


def rank_param_maps(arch: ModelArch) -> list[tuple[str, ParamMap, bool]]:
    """`stage_param_maps` of this rank's pipeline stage and expert-parallel rank."""
    return stage_param_maps(arch, *_pp(), *_ep()[:2])


def stage_param_maps(arch: ModelArch, pp_rank: int = 0, pp_size: int = 1, ep_rank: int = 0,
                     ep_size: int = 1) -> list[tuple[str, ParamMap, bool]]:
    """(local Megatron name, map with global HF names, emitted by iter_hf_weights) for every
    parameter of stage `pp_rank` on expert-parallel rank `ep_rank`, in the order of
    `Family.param_maps` (see the module docstring)."""
    first_layer, here = arch.stage_layers(pp_rank, pp_size)
    if arch.num_experts % ep_size != 0:
        raise ValueError(f"num_experts={arch.num_experts} is not divisible by --expert-model-parallel-size "
                         f"{ep_size}")
    local_experts = arch.num_experts // ep_size
    family, tied = arch.family, arch.tie_word_embeddings
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    embedding = [p for p in family.global_params if p.mcore.startswith("embedding.")]
    tail = [p for p in family.global_params if not p.mcore.startswith("embedding.")
            and not (p.untied_only and tied)]
    # a vision-language model's HF vision tower lives on the first stage (convert/vision.py)
    out = [(p.mcore, p, True) for p in (*arch.vision_params, *embedding)] if first else []
    for i in range(here):
        # megatron names a stage's layers from 0; HF globally. A dense layer of an MoE model has a dense MLP
        for p in arch.layer_maps(first_layer + i):
            local = p.at_layer(i).expand_experts(local_experts, ep_rank * local_experts)
            glob = p.at_layer(first_layer + i).expand_experts(local_experts, ep_rank * local_experts)
            out += [(lo.mcore, gl, True) for lo, gl in zip(local, glob, strict=True)]
    if last:
        # the multi-token-prediction layers (ModelArch.mtp_built) follow the decoder on the last stage; with PP that
        # stage keeps its own copy of the word embeddings for them (megatron all-reduces the copies' grads, as for
        # a tied output layer): loaded, never emitted
        for p in arch.mtp_maps():
            out += [(lo.mcore, gl, True) for lo, gl in zip(p.expand_experts(local_experts, 0),
                                                           p.expand_experts(local_experts, ep_rank * local_experts),
                                                           strict=True)]
        if arch.mtp_built and pp_size > 1:
            out += [(embedding[0].mcore, embedding[0], False)]
        out += [(p.mcore, p, True) for p in tail]
        if tied and pp_size > 1:
            out += [("output_layer.weight", embedding[0], False)]
    return out


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, checkpoint_dir: str | Path, arch: ModelArch) -> None:
    """Copy this TP rank's shard of every HF tensor into `model` (GPTModel or a wrapper).

    Strict both ways: every Megatron parameter must be written and every registry tensor must
    exist in the checkpoint (a tied model's lm_head.weight, if saved, is ignored)."""
    check_hf_weights(checkpoint_dir, arch)
    params = model_tensors(model)
    maps = stage_param_maps(arch, *_pp(), *_ep()[:2])
    extra = set(params) - {local for local, _, _ in maps}
    if extra:
        raise AssertionError(f"Megatron parameters without a registry entry: {sorted(extra)}")
    hf = read_hf_tensors(checkpoint_dir, sorted({n for _, pm, _ in maps for n in pm.hf}))
    for local, pm, _ in maps:
        split_rank, split_size, _ = _split(pm)
        shard = hf_to_mcore_shard(pm, [hf[n] for n in pm.hf], arch, split_rank, split_size)
        target = params[local]
        if tuple(shard.shape) != tuple(target.shape):
            raise ValueError(f"{checkpoint_dir}: {pm.hf} -> {local} gives shape {tuple(shard.shape)}, "
                             f"the model has {tuple(target.shape)} (config.json and weights disagree?)")
        target.copy_(shard.to(target.dtype))


def _gather_tp(t: torch.Tensor, tp_size: int, group: dist.ProcessGroup | None,
               replicated: bool = False) -> list[torch.Tensor]:
    if tp_size == 1 or replicated:  # every TP rank holds the same full tensor: nothing to gather
        return [t]
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(tp_size)]
    dist.all_gather(out, t, group=group)
    return out


def _emitted(model: torch.nn.Module, arch: ModelArch, skip_frozen: bool,
             buffers: bool = True) -> list[tuple[str, ParamMap]]:
    """What is sent and exported: every emitted entry, less the frozen parameters (skip_frozen) and the
    buffers (buffers=False: for a parameter's gradient, which a buffer has not)."""
    params = model_tensors(model)
    return [(local, pm) for local, pm, emit in stage_param_maps(arch, *_pp(), *_ep()[:2])
            if emit and (buffers or not pm.buffer)
            and not (skip_frozen and (pm.buffer or not lora.trains(params[local])))]


_EXPERT_INDEX = re.compile(r"(\.local_experts\.)\d+(\.)")  # Megatron's local expert index
# HF's global expert index: mlp.experts.{e}. (Qwen-MoE, GLM-4.5, DeepSeek-V3), block_sparse_moe.experts.{e}. (MiniMax)
_HF_EXPERT_INDEX = re.compile(r"(\.(?:mlp|block_sparse_moe)\.experts\.)\d+(\.)")


def _runs(emitted: list[tuple[str, ParamMap]]) -> Iterator[list[tuple[str, ParamMap]]]:
    """The emitted parameters in runs: a dense parameter alone, the local experts of one kind of
    one layer (fc1 or fc2) together, in order."""
    def kind(item: tuple[str, ParamMap]) -> str:
        return _EXPERT_INDEX.sub(r"\1{e}\2", item[0]) if item[1].expert else item[0]

    for _, run in itertools.groupby(emitted, key=kind):
        yield list(run)


def _as_expert(name: str, global_index: int) -> str:
    return _HF_EXPERT_INDEX.sub(rf"\g<1>{global_index}\g<2>", name)


def _ep_order(run_hf: list[list[tuple[str, torch.Tensor]]], ep_size: int, group: dist.ProcessGroup | None,
              n_local: int) -> Iterator[tuple[str, torch.Tensor]]:
    """One run of this rank's experts, each as its HF (name, tensor) pairs -> every EP rank's, in
    global expert order (EP rank r's local expert j is expert r * n_local + j). With a group,
    all-gathers each tensor over it (collective); with `group=None` (metadata) the tensors stand in
    for every rank's (same shape and dtype)."""
    gathered = []
    for pairs in run_hf:
        per_src = []
        for _, t in pairs:
            if group is None or ep_size == 1:
                per_src.append([t] * ep_size)
                continue
            got = [torch.empty_like(t) for _ in range(ep_size)]
            dist.all_gather(got, t.contiguous(), group=group)
            per_src.append(got)
        gathered.append(per_src)
    for src in range(ep_size):
        for j, pairs in enumerate(run_hf):
            for k, (name, _) in enumerate(pairs):
                yield _as_expert(name, src * n_local + j), gathered[j][k][src]


@torch.no_grad()
def iter_hf_weights(model: torch.nn.Module, arch: ModelArch,
                    skip_frozen: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for every HF tensor of this pipeline stage, identical on every
    rank of the stage (all of them with PP=1).

    Every rank of the TP group (and of the EP / ETP groups) must consume the generator to the end
    (it runs all-gathers). The tensors are in the model's dtype and on its device. Tied models yield
    only `model.embed_tokens.weight` (from stage 0), as HF's own state dict does. `skip_frozen`
    leaves out parameters that do not train (a --freeze-vision-tower tower: the engine keeps its copy)."""
    yield from iter_hf_tensors(model, arch, lora.merged, skip_frozen, buffers=True)


def iter_hf_tensors(model: torch.nn.Module, arch: ModelArch, get: Callable[[torch.nn.Parameter], torch.Tensor],
                    skip_frozen: bool = False, buffers: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_hf_weights` of `get(parameter)` for each parameter (e.g. its main_grad): gathered over
    TP (ETP and EP for experts), renamed and reshaped as the parameter itself would be; the registry's
    buffers (a router's expert_bias) too when `buffers`."""
    _, ep_size, ep_group = _ep()
    params = model_tensors(model)
    for run in _runs(_emitted(model, arch, skip_frozen, buffers)):
        run_hf = []
        for local, pm in run:
            _, split_size, group = _split(pm)
            shards = _gather_tp(get(params[local]), split_size, group, pm.layout is Layout.REPLICATED)
            run_hf.append(mcore_shards_to_hf(pm, shards, arch))
        if run[0][1].expert:
            yield from _ep_order(run_hf, ep_size, ep_group, len(run))
        else:
            yield from run_hf[0]


HFSource = tuple[str, torch.Tensor, tuple[int, ...]]


@dataclass
class _ViewPlan:
    arch: ModelArch
    pp: tuple[int, int]
    # per Megatron parameter of the stage: (owning module's _parameters, leaf name, the parameter,
    # its data_ptr, shape, dtype, requires_grad) -- what the views depend on
    signature: list[tuple]
    sources: list[HFSource]  # a source of a layout no view gives (COPIED_AT_TP1): a function that converts it
    copies: bool = False

    def valid(self, arch: ModelArch, pp: tuple[int, int]) -> bool:
        return (self.arch is arch or self.arch == arch) and self.pp == pp and all(
            owner.get(leaf) is p and p.data_ptr() == ptr and p.shape == shape and p.dtype == dtype
            and p.requires_grad == grad for owner, leaf, p, ptr, shape, dtype, grad in self.signature)


# unwrapped model -> {skip_frozen: plan}; weak, so a dropped model takes its views with it
_VIEW_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.no_grad()
def _build_view_plan(model: torch.nn.Module, arch: ModelArch, skip_frozen: bool) -> _ViewPlan:
    core = unwrap(model)
    pp = _pp()
    signature, sources = [], []
    emitted = dict(_emitted(model, arch, skip_frozen))
    for local, pm, _ in stage_param_maps(arch, *pp):
        owner_name, _, leaf = local.rpartition(".")
        module = core.get_submodule(owner_name)
        owner = module._parameters if leaf in module._parameters else module._buffers
        p = owner[leaf]
        signature.append((owner, leaf, p, p.data_ptr(), p.shape, p.dtype, p.requires_grad))
        if local not in emitted:
            continue
        for k, (name, view, shape) in enumerate(mcore_param_to_hf_views(pm, p.detach(), arch)):
            if (pm.layout, k) in COPIED_AT_TP1:  # no view gives it: converted again on every call
                sources.append((name, functools.partial(_hf_copy, pm, p.detach(), arch, k), shape))
                continue
            if view.untyped_storage().data_ptr() != p.untyped_storage().data_ptr():
                raise AssertionError(f"{local} -> {name}: the TP=1 conversion copied instead of viewing")
            sources.append((name, view, shape))
    return _ViewPlan(arch, pp, signature, sources, any(callable(src) for _, src, _ in sources))


def _hf_copy(pm: ParamMap, param: torch.Tensor, arch: ModelArch, k: int) -> torch.Tensor:
    """The k-th HF tensor of `param` at TP=1, converted now (a layout that no view gives: COPIED_AT_TP1)."""
    return mcore_shards_to_hf(pm, [param], arch)[k][1]


def iter_hf_sources(model: torch.nn.Module, arch: ModelArch, skip_frozen: bool = False) -> Iterator[HFSource]:
    """What weight sync sends: (hf_name, source, hf_shape) in `iter_hf_weights`' order, where
    `source` holds the HF tensor's elements in row-major order but may have a finer shape (a
    multi-group QKV split is a (groups, rows, ...) strided view; see `mcore_param_to_hf_views`).

    At TP=1 the sources are views of the parameters, built once per (model, skip_frozen) and reused:
    Megatron keeps each parameter's storage for the whole run (DDP buffers; the optimizer, checkpoint
    loads and the reference swap all write in place), so a view always reads the current values.
    The cache is checked on every call (each parameter still registered under its name, with the same
    data_ptr, shape, dtype and requires_grad) and rebuilt if anything moved. With TP > 1 the
    parameters are all-gathered into fresh tensors (`iter_hf_weights`); every TP rank must consume."""
    # not decorated with torch.no_grad: on a generator that switches grad mode around every item
    # (~3 us each, most of this function's cost); the views are detached when the plan is built
    # experts spread over EP (or split over ETP) are gathered too: no views of this rank's parameters
    # LoRA: the adapted weights are sent merged (lora.merged), which a view of the parameter cannot be
    if _tp()[1] > 1 or _ep()[1] > 1 or _etp()[1] > 1 or lora.adapters_of(unwrap(model)):
        for name, t in iter_hf_weights(model, arch, skip_frozen):
            yield name, t, tuple(t.shape)
        return
    plans = _VIEW_PLANS.setdefault(unwrap(model), {})
    plan = plans.get(skip_frozen)
    if plan is None or not plan.valid(arch, _pp()):
        plan = plans[skip_frozen] = _build_view_plan(model, arch, skip_frozen)
    if not plan.copies:
        yield from plan.sources
        return
    for name, src, shape in plan.sources:  # a layout no view gives (COPIED_AT_TP1): converted now (detached)
        yield name, (src() if callable(src) else src), shape


def hf_weight_metadata(model: torch.nn.Module, arch: ModelArch,
                       skip_frozen: bool = False) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(hf_name, dtype, shape) of what `iter_hf_weights` yields, in the same order, with no
    communication (weight sync announces the tensors before sending them). Shapes come from the
    same conversion code run on meta tensors, so they cannot drift from `iter_hf_weights`."""
    _, ep_size, _ = _ep()
    params = model_tensors(model)
    out = []
    for run in _runs(_emitted(model, arch, skip_frozen)):
        run_hf = []
        for name, pm in run:
            local = params[name]
            shards = [torch.empty(local.shape, dtype=local.dtype, device="meta")] * _split(pm)[1]
            run_hf.append(mcore_shards_to_hf(pm, shards, arch))
        pairs = _ep_order(run_hf, ep_size, None, len(run)) if run[0][1].expert else run_hf[0]
        out += [(name, t.dtype, tuple(t.shape)) for name, t in pairs]
    return out
