"""Does a planned run fit its GPUs? The verdicts `--dry-run` prints under the estimates, per trainer
GPU and per engine GPU, with the largest term named and the single flag changes that would make a
plan fit. Pure: config.json, the flags and the GPU's memory (`--cluster NODESxGPUS:GPU`, or the
local device's), nothing else.

**A trainer GPU** needs the estimate of `estimate.estimate_memory` (torch's allocated peak) times the
caching allocator's reserve above that peak, plus what the process holds outside torch's allocator
(CUDA context, cuBLAS workspaces, NCCL buffers): TRAINER_RESERVE and NON_TORCH_GIB below.

**An SGLang engine GPU** follows SGLang 0.5.23's own sizing (`srt/arg_groups/memory_hook.py`,
`handle_gpu_memory_settings`): the static pool (weights + KV cache) is `--mem-fraction-static` of
the GPU; without the flag SGLang takes (GPU - reserved) / GPU with reserved = 512 MiB + 1.5 MiB per
chunked-prefill token (8192 tokens on 60-160 GiB GPUs, 16384 above, 4096 below) + TP x PP / 8 GiB +
2 MiB per decode CUDA-graph batch size (256, or 512 from TP 4 and on GPUs above 160 GiB), at least
10 GiB on GPUs above 60 GiB. The KV cache gets the pool less the weights of one TP rank; one token
costs 2 (K and V) x attention layers x KV heads per rank (at least 1) x head_dim x the KV dtype's bytes
(Qwen3-Next's Gated DeltaNet layers keep a state per sequence instead, not counted). A
sample of prompt + response tokens that the cache cannot hold never runs: does not fit; a group of
--n-samples-per-prompt such samples that it cannot hold at once runs in turns (a note).

**Colocated** (`--colocate`): the trainer's weights, gradients and optimizer state stay on the GPU
while the engine generates (nothing offloads them), so SGLang sizes its pool from what is free
beside them, times its fraction (0.7 unless given, `engines.COLOCATED_MEM_FRACTION_STATIC`); while
the trainer trains, the engine has released its weights and KV cache but its process keeps its CUDA
context, counted on the trainer's side.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from slime_rl.config.builtin_engine import switch_value
from slime_rl.config.gpus import GpuMemory
from slime_rl.orchestration.estimate import GiB, MemoryEstimate, ModelShape, TrainerLayout, estimate_memory

# torch's caching allocator's reserve above the estimate (max_memory_reserved / the estimate: the
# estimate's own error and the allocator's fragmentation together) and the memory a trainer rank holds
# outside torch's allocator (CUDA context, cuBLAS workspaces), GiB. Measured by bench/train_memory.py on
# one H100 80GB, torch 2.11+cu130, 2026-12-05, five settings (0.5b/1.5b, 4096-16384-token
# micro-batches, with and without full recompute): reserved / estimate 1.09-1.22, outside torch 3.41 GiB
# in every run (bench/results/train_memory_reserve_1xH100_2026-12-05.jsonl). One rank, no NCCL
# communicator: NCCL's buffers on a multi-GPU run come on top (hundreds of MiB per communicator).
TRAINER_RESERVE = 1.22
NON_TORCH_GIB = 3.5


@dataclass(frozen=True)
class Verdict:
    """One GPU's verdict (a trainer's or an engine's) and the lines that explain it."""

    fits: bool
    lines: tuple[str, ...]


# ------------------------------------------------------------------------------------- trainer


def trainer_need_gib(mem: MemoryEstimate, extra_gib: float = 0.0) -> float:
    """GiB one trainer GPU needs at its peak: the estimate with the allocator's reserve, plus what lives
    outside torch's allocator, plus `extra_gib` (a colocated engine's CUDA context)."""
    return mem.total / GiB * TRAINER_RESERVE + NON_TORCH_GIB + extra_gib


_TERMS = ("weights", "grads", "optimizer", "activations", "logits")


def largest_term(mem: MemoryEstimate) -> str:
    return max(_TERMS, key=lambda t: getattr(mem, t))


@dataclass(frozen=True)
class Change:
    """A single flag change the trainer could make, and the layout it gives."""

    flags: str
    layout: TrainerLayout


def trainer_changes(shape: ModelShape, lay: TrainerLayout, world: int, sample_tokens: int = 0) -> list[Change]:
    """Single changes that keep the world size: full recompute, twice the TP or PP (DP shrinks), the
    most EP the experts allow, half the micro-batch tokens (not below one sample's), bf16."""
    out = []
    if lay.recompute_granularity != "full":
        out.append(Change("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                          dataclasses.replace(lay, recompute_granularity="full", recompute_method="uniform",
                                              recompute_num_layers=1)))
    if not lay.bf16:
        out.append(Change("--bf16", dataclasses.replace(lay, bf16=True)))
    tp2 = lay.tp * 2  # DP ranks give way to a larger TP or PP
    if lay.dp % 2 == 0 and shape.heads % tp2 == 0 and shape.kv_heads % tp2 == 0 and tp2 <= 8 and \
            (shape.lin_key_heads or tp2) % tp2 == 0:  # Qwen3-Next: whole Gated DeltaNet key heads per rank too
        out.append(Change(f"--tensor-model-parallel-size {tp2}" + ("" if lay.sequence_parallel
                                                                     else " --sequence-parallel"),
                          dataclasses.replace(lay, tp=tp2, dp=lay.dp // 2, sequence_parallel=True)))
    pp2 = lay.pp * 2
    if lay.dp % 2 == 0 and shape.layers % pp2 == 0:
        out.append(Change(f"--pipeline-model-parallel-size {pp2}", dataclasses.replace(lay, pp=pp2, dp=lay.dp // 2)))
    if shape.experts:
        etp = lay.etp or lay.tp
        room = world // (lay.pp * etp)  # EP x ETP divides the ranks of a pipeline stage
        ep = max((e for e in range(lay.ep + 1, room + 1) if room % e == 0 and shape.experts % e == 0), default=None)
        if ep:
            out.append(Change(f"--expert-model-parallel-size {ep}", dataclasses.replace(lay, ep=ep)))
    half = lay.tokens_per_micro_batch // 2
    if half >= max(1024, sample_tokens):
        out.append(Change(f"micro-batches of {half} tokens (--max-tokens-per-gpu or --micro-batch-size)",
                          dataclasses.replace(lay, tokens_per_micro_batch=half)))
    return out


def trainer_verdict(shape: ModelShape, lay: TrainerLayout, gpu: GpuMemory, colocated_context_gib: float = 0.0,
                    sample_tokens: int = 0) -> Verdict:
    """Fits / does not fit on one trainer GPU, the largest term, and the single changes that would fit
    (`sample_tokens`: the longest sample, below which a micro-batch cannot shrink)."""
    mem = estimate_memory(shape, lay)
    need = trainer_need_gib(mem, colocated_context_gib)
    world = lay.tp * lay.pp * lay.cp * lay.dp
    beside = f" + {colocated_context_gib:.2f} engine context" if colocated_context_gib else ""
    counted = (f"the estimate x {TRAINER_RESERVE:g} (allocator reserve) + {NON_TORCH_GIB:.2f} outside torch"
               if TRAINER_RESERVE != 1 or NON_TORCH_GIB else
               "the estimate: torch's allocated peak, without the allocator's reserve or the CUDA context")
    head = f"trainer GPU: needs {need:.2f} GiB of {gpu.gib:.2f} ({gpu.name}): {counted}{beside}"
    if need <= gpu.gib:
        return Verdict(True, (f"{head} -> fits ({gpu.gib - need:.2f} GiB spare)",))
    term = largest_term(mem)
    lines = [f"{head} -> DOES NOT FIT ({need - gpu.gib:.2f} GiB over); the largest term: {term} "
             f"{getattr(mem, term) / GiB:.2f} GiB"]
    fixes = _fixes(shape, lay, world, sample_tokens, colocated_context_gib)
    fitting = sorted(f for f in fixes if f[0] <= gpu.gib)
    if not fitting:  # two changes together (on different flags)
        pairs: dict[frozenset[str], tuple[float, str]] = {}
        for change in trainer_changes(shape, lay, world, sample_tokens):
            for alt, flags in _fixes(shape, change.layout, world, sample_tokens, colocated_context_gib):
                if flags.split()[0] != change.flags.split()[0]:
                    pairs.setdefault(frozenset((change.flags, flags)), (alt, f"{change.flags} and {flags}"))
        fixes2 = list(pairs.values())
        fitting = sorted(f for f in fixes2 if f[0] <= gpu.gib)
        fixes += fixes2
    if fitting:
        lines += [f"  fits with {flags}: {alt:.2f} GiB" for alt, flags in fitting[:3]]
    else:
        best = sorted(fixes)[:2]
        lines.append("  no change of one or two flags fits" + (": closest " + "; ".join(
            f"{flags} ({alt:.2f} GiB)" for alt, flags in best) if best else "")
            + "; spread the model over more GPUs (TP, PP, EP) or give the trainer more ranks")
    return Verdict(False, tuple(lines))


def _fixes(shape: ModelShape, lay: TrainerLayout, world: int, sample_tokens: int, extra_gib: float
           ) -> list[tuple[float, str]]:
    """(GiB needed, flags) of each single change of `trainer_changes` that can be estimated."""
    out = []
    for change in trainer_changes(shape, lay, world, sample_tokens):
        try:
            out.append((trainer_need_gib(estimate_memory(shape, change.layout), extra_gib), change.flags))
        except ValueError:  # e.g. a pipeline split the layers do not allow
            continue
    return out


# ------------------------------------------------------------------------------------- engines


def sglang_default_fraction(gpu: GpuMemory, tp: int, pp: int = 1, chunked_prefill: int | None = None,
                            decode_max_bs: int | None = None, cuda_graph: bool = True) -> float:
    """SGLang 0.5.23's --mem-fraction-static when not given (module docstring)."""
    mib = gpu.gib * 1024
    if chunked_prefill is None:
        chunked_prefill = 2048 if mib < 20 * 1024 else 4096 if mib < 60 * 1024 else 8192 if mib < 160 * 1024 \
            else 16384
    if decode_max_bs is None:
        decode_max_bs = 8 if mib < 20 * 1024 else (48 if tp < 4 else 160) if mib < 35 * 1024 \
            else (32 if tp < 4 else 160) if mib < 60 * 1024 else (256 if tp < 4 else 512) if mib < 160 * 1024 \
            else 512
    reserved = 512 + max(chunked_prefill, 2048) * 1.5 + tp * pp / 8 * 1024 + (decode_max_bs * 2 if cuda_graph else 0)
    if mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((mib - reserved) / mib, 3)


def kv_bytes_per_token(shape: ModelShape, tp: int, dtype_bytes: int) -> int:
    """K and V of every attention layer for one token on one TP rank (KV heads replicated when TP > KV heads);
    Qwen3-Next's Gated DeltaNet layers hold no per-token cache (their state is per sequence, not counted)."""
    layers = shape.layers - len(shape.linear_layers)
    return 2 * layers * max(1, shape.kv_heads // tp) * shape.head_dim * dtype_bytes


def _arg(args: dict, key: str) -> str | None:
    value = args.get(key)
    return None if value is None else str(value)


def engine_verdict(shape: ModelShape, weight_bytes: int, tp: int, gpu: GpuMemory, sglang_args: dict,
                   sample_tokens: int, group: int, model_bf16: bool, colocated_resident_gib: float | None = None
                   ) -> Verdict:
    """Fits / does not fit on one SGLang engine GPU: its static pool, the KV cache left beside the
    weights, in tokens, and whether one sample and one group fit at once (module docstring)."""
    weights_gib = weight_bytes / tp / GiB
    given = _arg(sglang_args, "mem_fraction_static")
    if given is not None:
        fraction, why = float(given), "--sglang-mem-fraction-static"
    elif colocated_resident_gib is not None:
        from slime_rl.orchestration.engines import COLOCATED_MEM_FRACTION_STATIC

        fraction, why = COLOCATED_MEM_FRACTION_STATIC, "colocated default"
    else:
        chunk, bs = _arg(sglang_args, "chunked_prefill_size"), _arg(sglang_args, "cuda_graph_max_bs_decode")
        graphs = not switch_value(sglang_args.get("disable_cuda_graph", False))
        fraction = sglang_default_fraction(gpu, tp, chunked_prefill=int(chunk) if chunk else None,
                                           decode_max_bs=int(bs) if bs else None, cuda_graph=graphs)
        why = "SGLang 0.5.23's default for this GPU"
    free = gpu.gib - (colocated_resident_gib or 0.0)
    if free <= 0:
        return Verdict(False, (
            f"engine GPU: DOES NOT FIT: the trainer's weights, gradients and optimizer state "
            f"({colocated_resident_gib:.2f} GiB, resident while the engine generates) leave nothing of "
            f"{gpu.gib:.2f} GiB ({gpu.name}) for the engine; make the trainer fit first",))
    pool = free * fraction
    where = (f"{fraction:g} ({why}) of the {free:.2f} GiB free beside the trainer's "
             f"{colocated_resident_gib:.2f} GiB" if colocated_resident_gib is not None
             else f"{fraction:g} ({why}) of {gpu.gib:.2f} GiB ({gpu.name})")
    kv_dtype = _arg(sglang_args, "kv_cache_dtype") or "auto"
    dtype_bytes = 1 if kv_dtype.startswith("fp8") else 2 if model_bf16 else 4
    per_token = kv_bytes_per_token(shape, tp, dtype_bytes)
    kv_gib = pool - weights_gib
    head = f"engine GPU: static pool {pool:.2f} GiB = {where}; weights {weights_gib:.2f} GiB (TP {tp})"
    if kv_gib <= 0:
        return Verdict(False, (f"{head} -> DOES NOT FIT: no room for a KV cache; raise "
                                             f"--rollout-num-gpus-per-engine (TP) or --sglang-mem-fraction-static",))
    tokens = int(kv_gib * GiB // per_token)
    lines = [f"{head}; KV cache {kv_gib:.2f} GiB = {tokens:,} tokens ({per_token / 1024:.1f} KiB per token)"]
    if tokens < sample_tokens:
        lines[0] += (f" -> DOES NOT FIT: one sample of {sample_tokens:,} tokens (prompt + --rollout-max-response-len) "
                     "needs more; raise --rollout-num-gpus-per-engine or shorten the responses")
        return Verdict(False, tuple(lines))
    at_once = tokens // sample_tokens
    lines[0] += f" -> fits: {at_once:,} samples of {sample_tokens:,} tokens at once"
    if at_once < group:
        lines.append(f"  note: a group of --n-samples-per-prompt {group} does not fit at once ({at_once}); its "
                     "samples take turns")
    return Verdict(True, tuple(lines))
