"""The built-in engine's precision policy in bf16/fp16: the fp32 islands SGLang keeps.

Why: RL needs the engine's log-probs of a token to equal the trainer's. In fp32 the HF model and
Megatron's GPTModel agree to ~1e-6 (FACTS.md); in bf16 they differed by 4e-2 on SmolLM2-135M,
because they round at different places. The trainer (Megatron, trainer/norm.py's RMSNorm) and
SGLang agree on where; stock HF modeling code does not. So the engine is brought to SGLang's rules:

| island    | SGLang 0.5.23 (and the trainer's RMSNorm, trainer/norm.py) | stock HF                     |
|-----------|-----------------------------------------------------------|-------------------------------|
| `rmsnorm` | `layernorm.py` forward_native: fp32 `(x * weight).to(dtype)` | bf16 `weight * x.to(dtype)` |
| `lm_head` | `logits_processor.py`, `--enable-fp32-lm-head`: fp32 logits | bf16 matmul, bf16 logits     |
| `attn_scores` | flash attention: q·k scores in fp32 inside the kernel | static decode step (attention.py): bf16 |

`rmsnorm` is always on (it is how SGLang and the trainer round), as is `attn_scores`: the static
decode step's attention (attention.py, the engine's own, not HF's) takes fp32 scores from the bf16
q and k, as the flash kernels of the trainer and of SGLang do. `lm_head` follows SGLang's own
switch, `--enable-fp32-lm-head` (off by default there too): a run passes `--sglang-enable-fp32-lm-head`
and the engines (SGLang or built-in) and the trainer (`slime_rl.trainer.model.fp32_output_layer`) all
compute fp32 logits, so one flag keeps the two sides alike. It is opt-in because the trainer's fp32
output layer is an fp32 GEMM over the whole vocabulary (slow at 150k vocabularies).
Log-softmax is fp32 on both sides already (`sampling.token_logprobs`, `trainer/logprobs.py`), and
RoPE (cos/sin computed in fp32, applied in the activation dtype) and the SDPA softmax (fp32 inside
the kernels) are done alike by HF, Megatron and SGLang, so they are left as they are.

Measured on CPU (bench/precision_gap.py --n 3 --new-tokens 24, SmolLM2-135M, 72 sampled tokens;
mean |dlogp| of the engine's decode path vs the trainer, then the engine's one-pass forward vs the
trainer): fp32 3.7e-6; bf16 stock 3.1e-2 / 4.2e-2; +rmsnorm 3.0e-2 / 0.0 (the forwards are then
equal bit for bit); +lm_head 2.6e-2 / 3.4e-2; both (default) 2.2e-2 / 0.0. What is left is
decode-vs-prefill numerics (one-token GEMMs take other kernels and round to bf16 elsewhere; an fp32
attention island leaves it as it is), which SGLang has as well (its answer is batch-invariant
kernels, --enable-deterministic-inference / rl_on_policy_target). fp32 logits shrink it because a
logit of ~20 in bf16 carries a rounding step of 0.125.

`SLIME_RL_FP32_ISLANDS` (comma list of islands, or `none` for stock HF) overrides the choice, for
`bench/precision_gap.py`, which measures the gap each one closes; runs do not set it. fp32 models
are untouched (every island is a no-op there).
"""

from __future__ import annotations

import os
import types

import torch
import torch.nn.functional as F

from slime_rl.engines.embedded.attention import FLASH_DECODE, FP32_SCORES

ISLANDS = ("rmsnorm", "lm_head", "attn_scores")
ENV = "SLIME_RL_FP32_ISLANDS"


def islands_from_env(default: frozenset[str] = frozenset(ISLANDS)) -> frozenset[str]:
    """The islands `SLIME_RL_FP32_ISLANDS` names (`default` when it is unset); an unknown name raises."""
    if ENV not in os.environ:
        return default
    raw = os.environ[ENV].strip()
    names = frozenset() if raw in ("", "none") else frozenset(s.strip() for s in raw.split(",") if s.strip())
    unknown = names - set(ISLANDS)
    if unknown:
        raise ValueError(f"{ENV}={raw!r}: unknown island(s) {sorted(unknown)}; known: {', '.join(ISLANDS)}, none")
    return names


def text_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The language model's decoder (a VL model's vision tower left out), or the model itself."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model


def is_rmsnorm(module: torch.nn.Module) -> bool:
    # HF's RMSNorms (LlamaRMSNorm, Qwen2RMSNorm, ...) all hold `weight` and `variance_epsilon`
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


def is_attention(module: torch.nn.Module) -> bool:
    # HF attention modules (LlamaAttention, Qwen2Attention, ...) hold their projections
    return hasattr(module, "q_proj") and hasattr(module, "o_proj")


def rmsnorm_fp32_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """SGLang's RMSNorm.forward_native (cast_x_before_out_mul=False): the weight multiplies the fp32
    normalized value, one rounding at the end."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.float()).to(dtype)


def _rmsnorm_fp32_weight(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rmsnorm_fp32_weight(hidden_states, self.weight, self.variance_epsilon)


def fp32_linear(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden @ weight.T with fp32 output and fp32 accumulation, from low-precision operands."""
    if hidden.is_cuda and hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16):
        try:  # bf16 operands, fp32 out (SGLang's path): no fp32 copy of the weight per step
            return torch.mm(hidden.reshape(-1, hidden.shape[-1]), weight.T,
                            out_dtype=torch.float32).view(*hidden.shape[:-1], weight.shape[0])
        except (TypeError, RuntimeError):  # older torch without out_dtype
            pass
    return F.linear(hidden.float(), weight.float())


def _lm_head_fp32(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return fp32_linear(hidden_states, self.weight)


def apply_precision_policy(model: torch.nn.Module, fp32_lm_head: bool = False,
                           islands: frozenset[str] | None = None) -> list[str]:
    """Patch `model`'s RMSNorm modules (always) and output embedding (`fp32_lm_head`) in place
    (instance methods, so weight updates and tied weights keep working); `islands` (or
    SLIME_RL_FP32_ISLANDS) overrides the choice. Returns what was patched, for the log."""
    if islands is None:
        islands = islands_from_env(frozenset({"rmsnorm", "attn_scores"} | ({"lm_head"} if fp32_lm_head else set())))
    dtype = next(model.parameters()).dtype
    if dtype == torch.float32 or not islands:
        return []
    done = []
    if "rmsnorm" in islands:
        n = 0
        # the language model only: a VL vision tower runs as stock HF code in the trainer too
        # (trainer/vision.py), so its norms must round as HF's do on both sides
        for module in text_decoder(model).modules():
            if is_rmsnorm(module):
                module.forward = types.MethodType(_rmsnorm_fp32_weight, module)
                n += 1
        done.append(f"rmsnorm x{n}")
    if "attn_scores" in islands:
        n = 0
        for module in text_decoder(model).modules():
            if is_attention(module):
                setattr(module, FP32_SCORES, True)
                n += 1
        done.append(f"attn_scores x{n}")
    if "lm_head" in islands:
        head = model.get_output_embeddings()
        if isinstance(head, torch.nn.Linear) and head.bias is None:
            head.forward = types.MethodType(_lm_head_fp32, head)
            done.append("lm_head")
    return done


def apply_deterministic_attention(model: torch.nn.Module) -> int:
    """--enable-deterministic-inference (SGLang's batch-invariant mode): mark the language model's
    attention layers so that the static path's decode steps run `attention.flash_slot_decode` over a
    time-major slot cache, on CUDA in bf16/fp16; elsewhere the marks change nothing. With the GEMMs,
    which are already invariant to the row count at these shapes (bench/gemm_invariance.py), a decode
    step then computes what the trainer's packed forward computes at that position. Returns the
    number of layers marked."""
    n = 0
    for module in text_decoder(model).modules():
        if is_attention(module):
            setattr(module, FLASH_DECODE, True)
            n += 1
    return n
