"""A layer's routed experts as one checkpoint tensor each (`Family.fused_experts`: Qwen3.5-MoE's published layout).

The registry names each routed expert's tensors (`...mlp.experts.{e}.gate_proj.weight` [width, hidden],
`up_proj.weight` [width, hidden], `down_proj.weight` [hidden, width]): what the trainer converts, what weight sync sends
(SGLang's Qwen3_5MoeForConditionalGeneration.load_weights takes them through FusedMoE's per-expert mapping) and what
transformers' save_pretrained writes. The published Qwen3.5-35B-A3B / Qwen3.6-35B-A3B checkpoints store a layer's
experts as two tensors, transformers' Qwen3_5MoeExperts parameters as they are:

    ...mlp.experts.gate_up_proj  [experts, 2 x width, hidden]  expert e's rows: its gate, then its up projection
    ...mlp.experts.down_proj     [experts, hidden, width]      expert e's down projection

(transformers' forward: `linear(x, gate_up_proj[e]).chunk(2, dim=-1)` is (gate, up); SGLang's fused loader
`chunk(2, dim=-2)` likewise.) This module maps one form to the other at the checkpoint file's boundary only: reading
(trainer/hf_files.py) slices an expert's tensor out of the fused one, writing (trainer/hf_export.py) stacks a layer's
experts back, both bit for bit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^.*\.mlp\.experts\.(gate_up_proj|down_proj)$")


def is_fused_name(name: str) -> bool:
    """Whether `name` is a layer's fused experts tensor (`...mlp.experts.gate_up_proj` / `down_proj`)."""
    return _FUSED.match(name) is not None


def fused_source(name: str) -> tuple[str, int, str] | None:
    """A per-expert name -> (the fused tensor holding it, the expert's index, "gate" / "up" / "down"); None for
    any other name."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    head, e, kind = m.group(1), int(m.group(2)), m.group(3)
    return (head + ("down_proj" if kind == "down_proj" else "gate_up_proj"), e, kind[:-len("_proj")])


def expert_slice(fused, e: int, part: str) -> torch.Tensor:  # noqa: ANN001
    """Expert e's tensor of a fused one: `fused` a tensor or safetensors' lazy slice (only those rows are read).
    gate_up_proj [experts, 2 x width, hidden]: the gate is rows [0, width) of expert e, the up rows [width, 2 width)."""
    if part == "down":
        return fused[e:e + 1][0]
    width = (fused.shape if isinstance(fused, torch.Tensor) else fused.get_shape())[1] // 2
    rows = slice(0, width) if part == "gate" else slice(width, 2 * width)
    return fused[e:e + 1, rows][0]


def fused_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The per-expert shapes of a model (`hf_shapes`) as the fused checkpoint stores them: each layer's experts
    folded into its gate_up_proj [experts, 2 x width, hidden] and down_proj [experts, hidden, width], where the
    layer's first expert tensor was; every other name as it is."""
    out: dict[str, tuple[int, ...]] = {}
    count: dict[str, int] = {}
    for name, shape in shapes.items():
        src = fused_source(name)
        if src is None:
            out[name] = shape
            continue
        fused, _, part = src
        count[fused] = count.get(fused, 0) + (1 if part != "up" else 0)
        if part == "gate":
            out[fused] = (0, 2 * shape[0], shape[1])
        elif part == "down":
            out[fused] = (0, *shape)
    return {n: ((count[n], *s[1:]) if n in count else s) for n, s in out.items()}


def fuse(tensors: Iterable[tuple[str, torch.Tensor]], num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in the registry's per-expert names -> the same with each layer's experts stacked into the
    fused tensors, each yielded once all `num_experts` experts of it have come (the trainer yields a layer's experts
    of one kind together, so at most one layer's are held); other names pass through in order."""
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in tensors:
        src = fused_source(name)
        if src is None:
            yield name, t
            continue
        fused, e, part = src
        parts = pending.setdefault(fused, {})
        parts[(e, part)] = t
        want = ("down",) if part == "down" else ("gate", "up")
        if len(parts) == num_experts * len(want):
            del pending[fused]
            yield fused, torch.stack([torch.cat([parts[(k, p)] for p in want]) for k in range(num_experts)])
    if pending:
        raise ValueError(f"experts missing from {sorted(pending)[:3]}: each fused tensor needs all {num_experts}")
