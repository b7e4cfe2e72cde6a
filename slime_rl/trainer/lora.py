"""LoRA adapters on Megatron's tensor-parallel linears (--lora-rank), as PEFT defines them.

An adapted HF linear `W` (q_proj, o_proj, gate_proj, ...) computes `W x + (B (A dropout(x))) * alpha / r`,
with A [r, in] initialised as nn.Linear's default (PEFT's kaiming-uniform: U(-1/sqrt(in), 1/sqrt(in))) and
B [out, r] zero, so the adapted model starts equal to the base. Megatron fuses HF linears (q/k/v into
linear_qkv, gate/up into linear_fc1); every HF linear keeps its own A and B, and their products are fused
into the Megatron layout exactly as the weights are (convert/shards.py), so the adapter of q_proj is
PEFT's adapter of q_proj whatever the layout.

Tensor parallelism (each rank holds a slice; the product always equals the unsharded layer's):
  * column-parallel (linear_qkv, linear_fc1, MLA's up projections): A whole on every rank, B split on
    its output rows like the weight. `h = A x` is replicated; its gradient sums the ranks' partial
    B^T dy: without sequence parallelism through megatron's copy-to-TP region (identity forward,
    all-reduce backward), with it `h` is computed on the rank's sequence chunk and all-gathered
    (reduce-scatter backward), and A's gradient, partial per chunk, is summed over TP by megatron's
    finalize_model_grads (the `sequence_parallel` attribute, as for norms under SP).
  * row-parallel (linear_proj, linear_fc2): A split on its input columns like the weight, B whole.
    `A_i x_i` are partial sums, all-reduced (SP: reduce-scattered onto the sequence chunks, B's gradient
    then summed over TP as above) before B.
Split parameters carry megatron's tensor-parallel attributes, so the gradient norm counts them once.
The initial A is drawn whole from a generator seeded by (--seed, HF name) and sliced, so every layout
starts from the same adapter.

The base weights are frozen (requires_grad False: not in DDP's buffers nor the optimizer); only the
adapters train. Weight sync and the HF export send merged weights (`merged`: W + B A alpha / r, in fp32,
rounded once to the weight's dtype), which every engine takes; `peft_state` gathers the adapters under
PEFT's names for adapter_model.safetensors. Dropout applies in the training forward only (gradients
enabled), as PEFT's in train mode; the log-prob forwards see the adapted model without it.
"""

from __future__ import annotations

import functools
import hashlib
import math
import types

import torch
import torch.nn.functional as F
from torch import nn

from slime_rl.config.families import Layout, ParamMap
from slime_rl.trainer.convert import ModelArch
from slime_rl.trainer.convert.lora_targets import (  # noqa: F401  (re-exported: the trainer's LoRA API)
    CHECKPOINT_KEY,
    COLUMN_LAYOUTS,
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    LoRASpec,
    adaptable,
    choose,
    hf_module,
    is_adapter_name,
    peft_config,
    peft_key,
    peft_modules,
    read_peft_config,
    read_peft_folder,
    sglang_adapter_config,
    short_name,
    spec_from_record,
    spec_of_folder,
    spec_record,
)
from slime_rl.trainer.mcore import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    make_sharded_tensors_for_checkpoint,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    set_tensor_model_parallel_attributes,
    tensor_parallel,
)


def _seed_of(seed: int, hf_name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{hf_name}".encode()).digest()[:8], "little") & (2**63 - 1)


def _fuse(layout: Layout, parts: list[torch.Tensor], dim: int, groups: int) -> torch.Tensor:
    """The Megatron layout of one rank's per-part tensors along `dim` (QKV: [q; k; v] per query group)."""
    if len(parts) == 1:
        return parts[0]
    if layout is not Layout.QKV:
        return torch.cat(parts, dim=dim)
    moved = [p.movedim(dim, 0) for p in parts]
    rest = moved[0].shape[1:]
    fused = torch.cat([p.reshape(groups, -1, *rest) for p in moved], dim=1).reshape(-1, *rest)
    return fused.movedim(0, dim)


class Adapter(nn.Module):
    """The adapters of one Megatron linear: A and B per adapted HF part (ParameterDicts keyed by the part's
    HF short name). `parts`: (short name, local output rows, adapted) in the fused order."""

    def __init__(self, layout: Layout, parts: list[tuple[str, int, bool]], in_local: int, in_full: int,
                 spec: LoRASpec, tp: tuple[int, int], sequence_parallel: bool, groups: int,
                 dtype: torch.dtype, device: torch.device, seed_names: dict[str, int]) -> None:
        super().__init__()
        self.layout, self.parts, self.spec, self.groups = layout, parts, spec, groups
        self.tp_rank, self.tp_size = tp
        self.sp = sequence_parallel and self.tp_size > 1
        self.column = layout in COLUMN_LAYOUTS
        # which of A and B is split over TP, and on which axis: B by output rows (column-parallel), A by input
        # columns (row-parallel), as the linear's weight is
        self.split, self.split_dim = ("B", 0) if self.column else ("A", 1)
        self.A, self.B = nn.ParameterDict(), nn.ParameterDict()
        r = spec.rank
        for name, rows, adapted in parts:
            if not adapted:
                continue
            gen = torch.Generator().manual_seed(seed_names[name])
            bound = 1.0 / math.sqrt(in_full)  # nn.Linear's (PEFT's) init of A: kaiming_uniform(a=sqrt(5))
            a_full = torch.empty(r, in_full).uniform_(-bound, bound, generator=gen)
            a = a_full if self.column else a_full.chunk(self.tp_size, dim=1)[self.tp_rank]
            assert a.shape[1] == in_local, (name, a.shape, in_local)
            # B's rows: the part's local output rows (row-parallel: the whole output, as every rank has it)
            self.A[name] = nn.Parameter(a.to(dtype=dtype, device=device).contiguous())
            self.B[name] = nn.Parameter(torch.zeros(rows, r, dtype=dtype, device=device))
            split, whole = (self.B[name], self.A[name]) if self.column else (self.A[name], self.B[name])
            if self.tp_size > 1:
                set_tensor_model_parallel_attributes(split, True, self.split_dim, 1)
            if self.sp:  # partial per sequence chunk: summed over TP in finalize_model_grads
                whole.sequence_parallel = True
        self.enabled = True

    def tp_axes(self) -> dict[str, int]:
        """Checkpoint axes of the split parameters (state-dict key -> axis)."""
        return {f"{self.split}.{n}": self.split_dim for n in self.A}

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        p = self.spec.dropout
        if not p or not (self.training and torch.is_grad_enabled()):
            return x
        if self.column and not self.sp:  # the same input on every TP rank: the same mask (default generator)
            return F.dropout(x, p, training=True)
        with tensor_parallel.get_cuda_rng_tracker().fork():  # this rank's slice: its own mask
            return F.dropout(x, p, training=True)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' term of the linear's output for its input `x` ([s, b, in_local])."""
        x = self._dropout(x)
        names = list(self.A)
        h = torch.cat([x @ self.A[n].t() for n in names], dim=-1) if len(names) > 1 else x @ self.A[names[0]].t()
        if self.column:
            if self.tp_size > 1:
                h = gather_from_sequence_parallel_region(h) if self.sp else copy_to_tensor_model_parallel_region(h)
            hs = dict(zip(names, h.split(self.spec.rank, dim=-1), strict=True))
            outs = [(hs[n] @ self.B[n].t()) * self.spec.scale if adapted
                    else h.new_zeros(*h.shape[:-1], rows) for n, rows, adapted in self.parts]
            return _fuse(self.layout, outs, -1, self.groups)
        if self.tp_size > 1:
            reduce = reduce_scatter_to_sequence_parallel_region if self.sp else reduce_from_tensor_model_parallel_region
            h = reduce(h)
        (n,) = names
        return (h @ self.B[n].t()) * self.spec.scale

    @torch.no_grad()
    def weight_delta(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """B A alpha / r of this rank's slice, in the Megatron layout of the linear's weight."""
        if not self.column:
            (n,) = list(self.A)
            return (self.B[n].to(dtype) @ self.A[n].to(dtype)) * self.spec.scale
        first = next(iter(self.A.values()))  # any adapted part's A: the input width and the device
        outs = [(self.B[n].to(dtype) @ self.A[n].to(dtype)) * self.spec.scale if adapted
                else torch.zeros(rows, first.shape[1], dtype=dtype, device=first.device)
                for n, rows, adapted in self.parts]
        return _fuse(self.layout, outs, 0, self.groups)


def _part_rows(pm: ParamMap, weight: torch.Tensor, arch: ModelArch, tp_size: int) -> list[int]:
    """The local output rows of each HF part of a weight (QKV: q, k, v; FC1: gate, up; else its rows)."""
    if pm.layout is Layout.QKV:
        groups = arch.num_query_groups // tp_size
        d = arch.kv_channels
        return [groups * (arch.num_attention_heads // arch.num_query_groups) * d, groups * d, groups * d]
    if pm.layout is Layout.FC1:
        return [weight.shape[0] // 2] * 2
    return [weight.shape[0]]


def _forward_with(linear: nn.Module, adapter: Adapter):
    inner = linear.forward

    @functools.wraps(inner)
    def forward(input_, *args, **kwargs):  # noqa: ANN001 - megatron's signature
        out, bias = inner(input_, *args, **kwargs)
        if adapter.enabled:
            out = out + adapter.delta(input_).to(out.dtype)
        return out, bias

    return forward


def _sharded_state_dict_with(linear: nn.Module, adapter: Adapter):
    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):  # noqa: ANN001
        own = self._modules.pop("lora")  # the linear's own entries as megatron writes them, then the adapter's
        try:
            out = type(self).sharded_state_dict(self, prefix, sharded_offsets, metadata)
        finally:
            self._modules["lora"] = own
        out.update(make_sharded_tensors_for_checkpoint(
            own.state_dict(prefix="", keep_vars=True), f"{prefix}lora.", own.tp_axes(), sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group")))
        return out

    return types.MethodType(sharded_state_dict, linear)


def attach(model: nn.Module, arch: ModelArch, stage_maps: list[tuple[str, ParamMap, bool]], spec: LoRASpec,
           seed: int, tp: tuple[int, int], sequence_parallel: bool) -> list[Adapter]:
    """Adapters on this rank's targeted linears (`stage_maps`: hf_io.stage_param_maps of the rank: local
    Megatron name, map with global HF names), every other parameter frozen. Returns the adapters."""
    tp_rank, tp_size = tp
    # a stage may hold none of the targets (GLM-4.5's dense gate_proj is on the first stage only); preflight
    # checks that the targets adapt something over the whole model
    chosen = choose([pm for _, pm, _ in stage_maps], spec.targets, check=False)
    for p in model.parameters():
        p.requires_grad_(False)
    adapters = []
    for local, pm, _ in stage_maps:
        if pm.mcore not in chosen:
            continue
        linear = model.get_submodule(local.rsplit(".", 1)[0])
        weight = linear.weight
        rows = _part_rows(pm, weight, arch, tp_size)
        in_local = weight.shape[1]
        in_full = in_local * tp_size if pm.layout is Layout.ROW else in_local
        names = [short_name(h) for h in pm.hf]
        parts = [(n, r, a) for n, r, a in zip(names, rows, chosen[pm.mcore], strict=True)]
        adapter = Adapter(pm.layout, parts, in_local, in_full, spec, (tp_rank, tp_size), sequence_parallel,
                          arch.num_query_groups // tp_size if pm.layout is Layout.QKV else 1,
                          weight.dtype, weight.device, {short_name(h): _seed_of(seed, h) for h in pm.hf})
        adapter.hf = dict(zip(names, (hf_module(h) for h in pm.hf), strict=True))  # part -> global HF module
        linear.lora = adapter
        linear.forward = _forward_with(linear, adapter)
        linear.sharded_state_dict = _sharded_state_dict_with(linear, adapter)
        weight.lora_adapter = adapter
        adapters.append(adapter)
    return adapters


def adapters_of(model: nn.Module) -> list[Adapter]:
    return [m for m in model.modules() if isinstance(m, Adapter)]


def merged(param: torch.Tensor) -> torch.Tensor:
    """A parameter as the engines and the HF export see it: an adapted weight merged with its adapter
    (in fp32, rounded once to the weight's dtype), any other parameter itself."""
    adapter = getattr(param, "lora_adapter", None)
    if adapter is None or not adapter.enabled:
        return param.detach()
    return (param.detach().float() + adapter.weight_delta(torch.float32)).to(param.dtype)


def trains(param: torch.Tensor) -> bool:
    """Whether a parameter's value can change in training: it has a gradient, or an adapter merges into it."""
    return param.requires_grad or getattr(param, "lora_adapter", None) is not None


def set_enabled(model: nn.Module, on: bool) -> None:
    """Turn every adapter on or off (off: the base model, the reference policy of a LoRA run)."""
    for a in adapters_of(model):
        a.enabled = on


def peft_state(adapters: list[Adapter], tp_group, get=None) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """This rank's adapters under PEFT's names (lora_A [r, in], lora_B [out, r], whole: the TP slices
    gathered), as CPU tensors; every TP rank of the stage must call it. `get(parameter)`: what to take of
    each (default its value; e.g. its main_grad)."""
    from slime_rl.trainer.hf_io import _gather_tp  # hf_io imports this module

    get = get or (lambda p: p.detach())

    out = {}
    for a in adapters:
        for n in a.A:
            for which, param in (("A", a.A[n]), ("B", a.B[n])):
                t = get(param)
                if which == a.split:  # the TP slices, whole
                    t = torch.cat(_gather_tp(t, a.tp_size, tp_group), dim=a.split_dim)
                out[peft_key(a.hf[n], which)] = t.to("cpu", copy=True).contiguous()
    return out


@torch.no_grad()
def load_peft_state(adapters: list[Adapter], tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy PEFT's adapter tensors (whole) into this rank's slices; ValueError naming the missing key or the
    wrong shape. Keys of adapters on other pipeline stages are left to them."""
    for a in adapters:
        for n in a.A:
            for which, param in (("A", a.A[n]), ("B", a.B[n])):
                key = peft_key(a.hf[n], which)
                t = tensors.get(key)
                if t is None:
                    raise ValueError(f"{source}: no {key} (the adapter does not cover {a.hf[n]}; its "
                                     "target_modules must be the run's)")
                if which == a.split:
                    t = t.chunk(a.tp_size, dim=a.split_dim)[a.tp_rank]
                if tuple(t.shape) != tuple(param.shape):
                    raise ValueError(f"{source}: {key} has shape {tuple(t.shape)}, this rank's slice is "
                                     f"{tuple(param.shape)} (another rank r or another model?)")
                param.copy_(t.to(param.dtype))
