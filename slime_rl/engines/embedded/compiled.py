"""--enable-torch-compile: the decode step's small elementwise kernels fused by torch.compile.

Why: a decode step of an HF model launches ~40 kernels per layer, most of them tiny elementwise
ones, and even replayed from a CUDA graph each costs a few microseconds: on the 1.5B shape at
batch 64, 4.6 of a step's 4.7 ms were spent outside attention while its weights read in 0.7 ms
(bench/decode_step.py, 1xH200). RMSNorm (with SGLang's fp32 island: convert, square, mean, rsqrt,
two products, convert back), RoPE (two products, the half rotation through a slice, a negation and
a concatenation, a sum, for q and for k) and SiLU(gate) * up are most of them.

What is compiled: those three pieces, each a free function of tensors (so one compile serves every
layer; dynamic shapes, so one serves every batch size), swapped in for a layer's RMSNorm and MLP
forwards and for the modeling module's `apply_rotary_pos_emb`. The GEMMs stay cuBLAS's and
attention and the KV-cache writes stay outside the compiled code. Compiling the whole step instead
was measured 2-5x SLOWER on the H200 (10.4 vs 4.7 ms at batch 64, 33.7 vs 6.2 ms at 256): the KV
cache's layers are views of one storage (slots.py), and the compiler, seeing aliased inputs
mutated in place, copied the whole cache around every layer's write.

When: only while `active` (graphs.StaticDecoder._run sets it for a static decode step whose padded
batch is at most --torch-compile-max-bs, SGLang's bound); prefill and larger batches run the
modules' own forwards. Under CUDA graphs the choice is made once, when a batch size's step is
captured. Numerics: the same expressions in the same dtypes, and with inductor's
`emulate_precision_casts` the bf16 intermediates of a fused chain (SiLU(gate) before the product,
RoPE's products) are rounded where the eager code rounds them, so the engine keeps rounding as the
trainer does: on CPU each piece equals the module's own forward bit for bit in bf16, and the
compiled step gives the uncompiled one's tokens and log-probs (tests/engines/test_embedded_compile.py).
"""

from __future__ import annotations

import inspect
import logging
import sys
import types

import torch
import torch.nn.functional as F

from slime_rl.config.families import FAMILIES
from slime_rl.engines.embedded.precision import is_attention, is_rmsnorm, rmsnorm_fp32_weight, text_decoder
from slime_rl.engines.embedded.sampling import gumbel_pick

logger = logging.getLogger(__name__)
# inductor keeps a fused chain's bf16 intermediates in fp32 unless told to round them where eager
# code does: with this the pieces equal the modules' own forwards bit for bit (bf16 on CPU, tests)
OPTIONS = {"emulate_precision_casts": True}
# RMSNorm classes whose own forward is `_rms_norm(..., fp32_weight=False)` (each family's hf_rmsnorm)
STOCK_RMSNORMS = frozenset(f.hf_rmsnorm for f in FAMILIES.values() if f.hf_rmsnorm)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fp32_weight: bool) -> torch.Tensor:
    # the two RMSNorm forwards the engine runs: SGLang's fp32-weight island (precision.py) and stock
    # HF's (normalize in fp32, round, then multiply by the weight in its dtype)
    if fp32_weight:
        return rmsnorm_fp32_weight(x, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _silu_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


class CompiledPieces:
    """Installs the compiled pieces on `model` (text decoder layers only) and switches them with
    `active`. `installed` lists what was swapped, for the log and the tests."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.active = False
        self.calls = 0  # compiled calls made (while active), for the tests
        self.installed: list[str] = []
        self._rms = torch.compile(_rms_norm, dynamic=True, options=OPTIONS)
        self._mlp = torch.compile(_silu_mlp, dynamic=True, options=OPTIONS)
        decoder = text_decoder(model)
        n_norm = n_mlp = 0
        for module in decoder.modules():
            name = type(module).__name__
            if is_rmsnorm(module):
                n_norm += self._wrap_norm(module)
            elif (name.endswith("MLP") and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj"))
                  # transformers' "silu": torch.nn.SiLU, or its own SiLUActivation (F.silu) in 5.2x
                  and type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
                  and all(getattr(module, p).bias is None for p in ("gate_proj", "up_proj", "down_proj"))):
                self._wrap_mlp(module)
                n_mlp += 1
        self.installed += [f"rmsnorm x{n_norm}", f"silu_mlp x{n_mlp}"]
        self._wrap_rope(decoder)

    def _wrap_norm(self, module: torch.nn.Module) -> bool:
        eager = module.forward
        # precision.py's island replaces the instance's forward; otherwise it is the class's, whose
        # formula is known for the registry's families only
        fp32_weight = getattr(eager, "_slime_fp32_weight", None)  # wrapped before (another decoder)
        if fp32_weight is None:
            fp32_weight = getattr(eager, "__func__", None) is not type(module).forward
        if not fp32_weight and type(module).__name__ not in STOCK_RMSNORMS:
            return False

        def forward(hidden_states: torch.Tensor) -> torch.Tensor:
            if not self.active:
                return eager(hidden_states)
            self.calls += 1
            return self._rms(hidden_states, module.weight, module.variance_epsilon, fp32_weight)

        forward._slime_fp32_weight = fp32_weight
        module.forward = forward
        return True

    def _wrap_mlp(self, module: torch.nn.Module) -> None:
        eager = module.forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            if not self.active:
                return eager(x)
            self.calls += 1
            return self._mlp(x, module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight)

        module.forward = forward

    def _wrap_rope(self, decoder: torch.nn.Module) -> None:
        """Swap the modeling module's `apply_rotary_pos_emb` (the attention forwards look it up there
        at call time) for one that runs compiled while active; other models in the process see the
        original whenever no step is active."""
        attn = next((m for m in decoder.modules() if is_attention(m)), None)
        mod = sys.modules.get(type(attn).__module__) if attn is not None else None
        original = getattr(mod, "apply_rotary_pos_emb", None)
        original = getattr(original, "_slime_eager", original)  # installed before (another engine here)
        plain = rope_function(original)
        if plain is None:
            logger.info("embedded engine: torch.compile: no apply_rotary_pos_emb in %s; RoPE runs as it is",
                        getattr(mod, "__name__", None))
            return
        compiled = torch.compile(plain, dynamic=True, options=OPTIONS)
        owners: list[CompiledPieces] = getattr(mod.apply_rotary_pos_emb, "_slime_owners", [])

        def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
            if any(o.active for o in owners):
                return compiled(q, k, cos, sin, *args, **kwargs)
            return original(q, k, cos, sin, *args, **kwargs)

        owners.append(self)
        apply_rotary_pos_emb._slime_eager = original
        apply_rotary_pos_emb._slime_owners = owners
        mod.apply_rotary_pos_emb = apply_rotary_pos_emb
        self.installed.append("rope")


def rope_function(obj: object) -> types.FunctionType | None:
    """The plain function behind a modeling module's `apply_rotary_pos_emb`, or None.

    Up to transformers 5.24 it is a function. From 5.25 transformers requires `kernels`, whose
    `use_kernel_forward_from_hub` turns a decorated function into an instance of a one-off
    `nn.Module` class whose forward calls the function (or a hub kernel once a model has been
    `kernelize`d); the function is only in that forward's closure (`func`). The engine never
    kernelizes, so compiling the function itself is what the module would run."""
    if isinstance(obj, types.FunctionType):
        return obj
    if isinstance(obj, torch.nn.Module):
        try:
            fn = inspect.getclosurevars(type(obj).forward).nonlocals.get("func")
        except (TypeError, AttributeError):
            return None
        if isinstance(fn, types.FunctionType) and fn.__name__ == "apply_rotary_pos_emb":
            return fn
    return None


class CompiledSampler:
    """sampling.gumbel_pick compiled: the division by the temperature, the row's log-normalizer and
    the Gumbel-max argmax fused into a few passes over [B, V] (eager: about ten, one kernel each):
    0.37 instead of 0.87 ms at batch 256 on the 1.5B shape's 152k vocabulary, where a decode step
    takes ~5 ms (bench/decode_step.py, 1xH200). The uniform draws stay eager (the rows' own
    generators). If the compile fails, it warns once and samples eagerly from then on, with the
    same draws."""

    def __init__(self) -> None:
        self._fn = torch.compile(gumbel_pick, dynamic=True, options=OPTIONS)
        self.calls = 0
        self.failed: str | None = None

    def __call__(self, logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor | None,
                 sampled: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.failed is None:
            try:
                out = self._fn(logits, temperature, u, sampled)
                self.calls += 1
                return out
            except Exception as e:  # noqa: BLE001 - any compiler failure: fall back, say why
                self.failed = str(e)
                logger.warning("embedded engine: torch.compile of the sampler failed; sampling without it "
                               "from now on: %s", e)
        return gumbel_pick(logits, temperature, u, sampled)
