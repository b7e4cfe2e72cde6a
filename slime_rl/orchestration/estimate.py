"""What a planned run needs, from config.json alone: parameters, trainer memory per GPU, weight-sync time.

`--dry-run` prints these next to the placement (`train.dry_run`); nothing here loads weights, starts a
process or touches a device, so a folder holding only config.json is enough, and a run can be planned
for a cluster one is not on (`--cluster NODESxGPUS`).

**Parameters** are counted from the config's sizes by the formulas of the HF modules (embedding,
attention with GQA and its biases, q/k norms (per head, or MiniMax-M2's over all heads), SwiGLU MLP or MoE
experts and router, RMSNorms (GLM-4's two more per layer, after attention and after the MLP), the LM head unless
tied, the Qwen2.5-VL vision tower); tests/orchestration/test_estimate.py checks the count
against transformers' own model built from the same config on the meta device.

**Trainer memory per GPU** follows the trainer's settings (trainer/worker.py): bf16 parameters (fp32
without --bf16); an fp32 gradient buffer of every local parameter (DDP with grad_reduce_in_fp32, the
role of Megatron's --accumulate-allreduce-grads-in-fp32); the distributed optimizer's fp32 master
weights and Adam moments sharded over the data-parallel x context-parallel ranks -- the bytes per
parameter of Megatron's docs/source/api-guide/dist_optimizer.md table: 2 + 4 + 12 / d for bf16 params
with fp32 grads, 4 + 4 + 8 / d for fp32. Activations use the method of Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models" (arXiv:2205.05198, section 4.1): count every
tensor autograd keeps for the backward pass, per layer and token, in bytes. Their GPT layer keeps
s*b*h*(34 + 5*a*s/h); for the layer we build (megatron local spec, RMSNorm, GQA, SwiGLU, no dropout,
flash attention -- no s x s score matrix is stored) the same count is, per token, with t the TP size
and t_sp = t under --sequence-parallel (else 1):

    norms' inputs and outputs (= qkv / fc1 inputs)       8h / t_sp
    q, k, v after RoPE (kept by flash attention)         2(q + 2kv) / t       (kv -> q if k/v are expanded)
    attention output (= linear_proj input)               2q / t
    softmax log-sum-exp (fp32 per head)                  4a / t
    q/k norm inputs (Qwen3)                              2(q + kv) / t        (MiniMax-M2 gathers the heads: 2(q + kv))
    post-attention and post-MLP norm inputs (GLM-4)      4h / t_sp
    SwiGLU: fc1 output [2f], silu(gate), fc2 input       8f / t
    (MoE layers: f -> top-k x expert ffn; router logits 4E)

and a Gated DeltaNet layer (Qwen3-Next's linear attention, megatron's GatedDeltaNet) in place of the attention
rows, with kd = key heads x key width, vd = value heads x value width, nv = value heads:

    convolution input and its pre-activation output      4(2kd + vd) / t
    q, k before (l2 norm inputs) and after, expanded      (4kd + 4 nv dk) / t  (each value head its key head's)
    v, the decay g (fp32), beta                          (2vd + 6nv) / t
    gated output norm: input, gate, norm output, product  8vd / t

where q = heads x head_dim, kv = kv heads x head_dim, f = ffn size. Recompute (Megatron's flags):
`full` + `uniform` + N keeps each chunk of N layers' input (2h / t_sp) and recomputes one chunk at a time
during backward; `full` + `block` + N keeps only the input of the first N layers of a stage; `selective`
recomputes the core attention, which with flash attention saves only the log-sum-exp. The last stage
adds the LM head's logits: 12 bytes per (token x vocab / t) at their peak in the loss (fp32 logits, the
response slice, their temperature-scaled copy that the cross entropy turns into softmax in place).
Pipeline stages hold min(pp - stage, micro-batches) micro-batches in flight (1F1B), the first the most.
Not counted: the vision tower's activations, temporary buffers of the backward pass and allocator
fragmentation; the reference model lives in host memory (a CPU copy swapped in).

**Weight-sync time** = bytes of the HF weights the engines receive / a link bandwidth, plus the bytes the
source ranks first gather from the other TP and EP ranks / --plan-intra-node-gbps (`gathered_params`;
the two counted one after the other), plus the fixed cost per sync measured on 2xH200 (pause, continue,
HTTP answers; /work/shared/FACTS.md). The link's bandwidth is --plan-intra-node-gbps when every engine
sits on the node of the trainer's source ranks, else --plan-inter-node-gbps (an assumption: never
measured here). docs/launch.md compares all three estimates with measured runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from slime_rl.config.families import FAMILIES, Layout

GiB = 2**30
# fixed per-sync cost of the disaggregated path (pause, continue, the engines' answers), measured on
# 2xH200 with bench/weight_sync.py (FACTS.md: "about 3.5 ms of fixed cost per sync")
SYNC_FIXED_S = 0.0035
# colocated: a whole sync (release/resume, CUDA IPC hand-over) of the Qwen2.5-0.5B shape's 0.99 GB took
# 61.6-62.8 ms on one H200 (bench/results/gpu_e2e_0.5b_colocated_1xH200_2026-11-30.metrics.jsonl, steps 1-2)
COLOCATED_GBPS = 16.0
# bytes per (token x local vocab) at the loss's peak: fp32 logits, the response slice, its scaled copy
LOGITS_BYTES = 12

# transformers' Qwen2_5_VLVisionConfig defaults, for keys a config.json leaves out
_VISION_DEFAULTS = {"depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "in_channels": 3, "patch_size": 14,
                    "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 3584}


@dataclass(frozen=True)
class VisionShape:
    """Qwen2.5-VL's vision tower: patch embedding (Conv3d, no bias), `depth` blocks (two RMSNorms,
    fused qkv and proj with biases, SwiGLU with biases) and the patch merger (RMSNorm, two linears).
    Qwen3.5's (`position_table` > 0: its learned position embeddings' rows): the Conv3d with a bias, LayerNorms
    (weight and bias), a GELU MLP of two linears with biases, the merger's norm a LayerNorm."""

    depth: int
    hidden: int
    ffn: int
    in_channels: int
    patch: int
    temporal_patch: int
    merge: int
    out_hidden: int
    position_table: int = 0

    @property
    def params(self) -> int:
        h, f = self.hidden, self.ffn
        patch = self.in_channels * self.temporal_patch * self.patch**2 * h
        m = h * self.merge**2
        if self.position_table:  # Qwen3.5
            block = 4 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
            merger = 2 * h + (m * m + m) + (m * self.out_hidden + self.out_hidden)
            return patch + h + self.position_table * h + self.depth * block + merger
        block = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * (h * f + f) + (f * h + h)
        merger = h + (m * m + m) + (m * self.out_hidden + self.out_hidden)
        return patch + self.depth * block + merger


@dataclass(frozen=True)
class ModelShape:
    """The sizes of an HF decoder (and vision tower) that parameters, memory and sync depend on."""

    model_type: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    experts: int = 0  # MoE: routed experts per MoE layer (0: dense)
    expert_ffn: int = 0
    top_k: int = 0
    moe_layers: tuple[int, ...] = ()
    vision: VisionShape | None = None
    shared_ffn: int = 0  # the shared expert's width in every MoE layer (0: none)
    shared_gate: bool = True  # Qwen2-MoE's shared expert has a [1, h] sigmoid gate; GLM-4.5's none
    # multi-latent attention (DeepSeek-V3; kv_lora 0: none): the latent widths and each head's channels
    q_lora: int = 0
    kv_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0
    post_norms: bool = False  # GLM-4: an RMSNorm after attention and one after the MLP in every layer
    # MiniMax-M2: the q/k norms span all heads' channels (weights q and kv wide, whole on every TP rank; each TP rank
    # normalizes the gathered heads, so their inputs are kept whole)
    qk_norm_whole: bool = False
    # Qwen3-Next: the full attention's q_proj twice as wide (each head's query and its output gate), and the
    # Gated DeltaNet layers (their indices) with their key/value heads and widths and the convolution's width
    output_gate: bool = False
    linear_layers: tuple[int, ...] = ()
    lin_key_heads: int = 0
    lin_value_heads: int = 0
    lin_key_dim: int = 0
    lin_value_dim: int = 0
    lin_conv: int = 0
    fused_gate_up: bool = False  # GLM-4: the MLP's gate and up are one HF linear (gate_up_proj), which LoRA leaves
    # DeepSeek Sparse Attention (GLM-5): the layers with their own lightning indexer (whole on every TP rank: wq_b
    # [index heads x index width, q_lora], wk [index width, h], its LayerNorm's weight and bias, weights_proj
    # [index heads, h]; frozen, so counted as parameters without gradients or optimizer state being told apart)
    indexer_layers: tuple[int, ...] = ()
    index_heads: int = 0
    index_head_dim: int = 0

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def attention_params(self) -> tuple[int, int]:
        """(TP-split, replicated) parameters of one layer's attention block and its two RMSNorms (four with
        GLM-4's post norms)."""
        h, q, kv = self.hidden, self.q, self.kv
        if self.kv_lora:  # MLA: up projections split over TP, the down projections and latent norms whole
            n, qk = self.heads, self.qk_nope + self.qk_rope
            split = (self.q_lora if self.q_lora else h) * n * qk + self.kv_lora * n * (self.qk_nope + self.v_head)
            split += n * self.v_head * h
            replicated = 2 * h + (h * self.q_lora + self.q_lora if self.q_lora else 0)
            return split, replicated + h * (self.kv_lora + self.qk_rope) + self.kv_lora
        split = h * q * (2 if self.output_gate else 1) + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        qk_norm = (q + kv if self.qk_norm_whole else 2 * self.head_dim) if self.qk_norm else 0
        replicated = 2 * h + qk_norm + (h if self.o_bias else 0)
        return split, replicated + (2 * h if self.post_norms else 0)

    def linear_attention_params(self) -> tuple[int, int]:
        """(TP-split, replicated) parameters of one Gated DeltaNet layer's token mixer and its two RMSNorms:
        in_proj_qkvz [2kd + 2vd, h], in_proj_ba [2nv, h], the depthwise conv1d [2kd + vd, 1, width], dt_bias and
        A_log [nv], out_proj [h, vd] split over TP; the two layer norms and the gated output norm [value width]
        whole."""
        h, nv = self.hidden, self.lin_value_heads
        kd, vd = self.lin_key_heads * self.lin_key_dim, nv * self.lin_value_dim
        split = h * (2 * kd + 2 * vd) + h * 2 * nv + (2 * kd + vd) * self.lin_conv + 2 * nv + vd * h
        return split, 2 * h + self.lin_value_dim

    def indexer_params(self) -> int:
        """Parameters of one sparse-attention indexer (whole on every TP rank)."""
        d = self.index_head_dim
        return self.q_lora * self.index_heads * d + self.hidden * d + 2 * d + self.hidden * self.index_heads

    def mixer_params(self, layer: int) -> tuple[int, int]:
        """(TP-split, replicated) parameters of layer `layer`'s attention (or Gated DeltaNet) and its norms, with its
        sparse-attention indexer where it has one."""
        if layer in self.linear_layers:
            return self.linear_attention_params()
        split, rep = self.attention_params()
        return split, rep + (self.indexer_params() if layer in self.indexer_layers else 0)

    def dense_mlp_params(self) -> int:
        h, f = self.hidden, self.ffn
        return 3 * h * f + (2 * f + h if self.mlp_bias else 0)

    def moe_params(self) -> tuple[int, int]:
        """(experts, router) parameters of one MoE layer."""
        return self.experts * 3 * self.hidden * self.expert_ffn, self.hidden * self.experts

    def shared_expert_params(self) -> tuple[int, int]:
        """(TP-split, replicated) parameters of one MoE layer's shared expert: its SwiGLU, its gate."""
        if not self.shared_ffn:
            return 0, 0
        return 3 * self.hidden * self.shared_ffn, self.hidden if self.shared_gate else 0

    def lora_params(self, rank: int, targets: tuple[str, ...], moe_layer: bool = False) -> tuple[int, int]:
        """(TP-split, replicated) LoRA adapter parameters of one layer (trainer/lora.py): a column-parallel
        linear (q/k/v/gate/up) keeps A [r, in] whole and splits B [out, r]; a row-parallel one (o/down) splits
        A [r, in] and keeps B [out, r] whole. MoE layers: the attention and the shared expert (routed experts
        take no adapters)."""
        every = "all-linear" in targets
        h, q, kv, r = self.hidden, self.q, self.kv, rank
        ffn = self.shared_ffn if moe_layer else self.ffn
        linears = {"q_proj": (h, q, True), "k_proj": (h, kv, True), "v_proj": (h, kv, True), "o_proj": (q, h, False),
                   **({"gate_proj": (h, ffn, True), "up_proj": (h, ffn, True), "down_proj": (ffn, h, False)}
                      if ffn else {})}
        if self.fused_gate_up:  # one gate_up_proj: no adapter (convert/lora_targets.py)
            linears = {k: v for k, v in linears.items() if k not in ("gate_proj", "up_proj")}
        split = rep = 0
        for name, (fan_in, fan_out, column) in linears.items():
            if every or name in targets:
                split += r * fan_out if column else r * fan_in
                rep += r * fan_in if column else r * fan_out
        return split, rep

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Every parameter of the HF model (the LM head once when tied, the vision tower included)."""
        total = sum(sum(self.mixer_params(i)) for i in range(self.layers)) + self.hidden  # + final norm
        n_moe = len(self.moe_layers)
        total += (self.layers - n_moe) * self.dense_mlp_params() + n_moe * sum(self.moe_params())
        total += n_moe * sum(self.shared_expert_params())
        total += self.embedding_params * (1 if self.tied else 2)
        return total + (self.vision.params if self.vision else 0)


def _need(cfg: dict[str, Any], key: str, where: str) -> int:
    if key not in cfg:
        raise ValueError(f"{where}: no {key!r}; the estimate needs the model's sizes")
    return int(cfg[key])


def model_shape(config: dict[str, Any], where: str = "config.json") -> ModelShape:
    """ModelShape of an HF config.json (vision-language configs may nest the decoder in text_config)."""
    model_type = config.get("model_type", "")
    if model_type not in FAMILIES:
        raise ValueError(f"{where}: model_type {model_type!r} cannot be estimated; supported: {list(FAMILIES)}")
    # what the family implies beyond config.json's sizes (its biases, norms, experts, vision tower)
    family = FAMILIES[model_type]
    # Qwen3.5 (Family.text_config): the decoder's fields in text_config
    cfg = {**config, **(config.get("text_config") or {})} if family.vision or family.text_config else config
    hidden, heads = _need(cfg, "hidden_size", where), _need(cfg, "num_attention_heads", where)
    layers = _need(cfg, "num_hidden_layers", where)
    attention_bias = bool(family.config_value(cfg, "attention_bias", False))
    # hub configs say num_experts (DeepSeek-style: n_routed_experts); transformers 5 writes num_local_experts
    experts = int(cfg.get("num_experts") or cfg.get("n_routed_experts") or family.config_value(cfg, "num_local_experts")
                  or family.config_value(cfg, "num_experts") or 0) if family.moe else 0
    moe_layers: tuple[int, ...] = ()
    shared_ffn = 0
    if experts and family.deepseek_moe:  # the first first_k_dense_replace layers dense; n_shared_experts
        moe_layers = tuple(range(int(family.config_value(cfg, "first_k_dense_replace", 0)), layers))
        shared_ffn = int(family.config_value(cfg, "n_shared_experts", 0)) * int(cfg.get("moe_intermediate_size") or 0)
    elif experts and not family.dense_layer_params and family.text_config:
        # Qwen3.5-MoE: every layer an MoE block (its transformers and SGLang classes read no mlp_only_layers)
        moe_layers = tuple(range(layers))
        shared_ffn = int(family.config_value(cfg, "shared_expert_intermediate_size") or 0)
    elif experts:
        step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
        moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        if family.shared_expert:
            shared_ffn = int(cfg.get("shared_expert_intermediate_size") or 0)
    linear: dict[str, Any] = {}
    if family.gated_delta_net:  # Qwen3-Next: which layers are Gated DeltaNet (convert/arch.py reads it the same way)
        from slime_rl.trainer.convert.arch import arch_from_hf_config

        arch = arch_from_hf_config(config, where=where)  # the file as it is (Qwen3.5: text_config's model_type)
        linear = {"output_gate": arch.attention_output_gate,
                  "linear_layers": tuple(i for i in range(layers) if arch.is_linear_layer(i)),
                  "lin_key_heads": arch.linear_num_key_heads, "lin_value_heads": arch.linear_num_value_heads,
                  "lin_key_dim": arch.linear_key_head_dim, "lin_value_dim": arch.linear_value_head_dim,
                  "lin_conv": arch.linear_conv_kernel_dim}
    dsa: dict[str, Any] = {}
    if family.dsa:  # GLM-5: which layers hold an indexer (convert/arch.py reads indexer_types and its schedule keys)
        from slime_rl.trainer.convert.arch import arch_from_hf_config

        arch = arch_from_hf_config(config, where=where)
        dsa = {"indexer_layers": tuple(i for i in range(layers) if arch.has_indexer(i)),
               "index_heads": arch.dsa_index_heads, "index_head_dim": arch.dsa_index_head_dim}
    mla: dict[str, int] = {}
    if family.mla:  # the widths as config.json gives them (Family.mla_dims), under ModelShape's names
        dims = family.mla_dims(cfg)
        mla = {"q_lora": dims["q_lora_rank"], "kv_lora": dims["kv_lora_rank"], "qk_nope": dims["qk_nope_head_dim"],
               "qk_rope": dims["qk_rope_head_dim"], "v_head": dims["v_head_dim"]}
    vision = None
    # Qwen3.5 (text_config): the tower where config.json has a vision_config (the trainer builds it then)
    if family.builds_vision(config):
        # Qwen3.5: transformers' Qwen3_5VisionConfig defaults for what the file leaves out
        defaults = ({**_VISION_DEFAULTS, "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "patch_size": 16,
                     "num_position_embeddings": 2304, "out_hidden_size": 3584} if family.text_config
                    else _VISION_DEFAULTS)
        vc = {**defaults, **(config.get("vision_config") or {})}
        vision = VisionShape(depth=int(vc["depth"]), hidden=int(vc["hidden_size"]), ffn=int(vc["intermediate_size"]),
                             in_channels=int(vc.get("in_chans", vc["in_channels"])), patch=int(vc["patch_size"]),
                             temporal_patch=int(vc["temporal_patch_size"]), merge=int(vc["spatial_merge_size"]),
                             out_hidden=int(vc["out_hidden_size"]),
                             position_table=int(vc["num_position_embeddings"]) if family.text_config else 0)
    return ModelShape(
        model_type=model_type, layers=layers, hidden=hidden,
        # no dense MLP in any layer (Qwen3.5-MoE's config has no intermediate_size): none to count
        ffn=0 if experts and len(moe_layers) == layers and "intermediate_size" not in cfg
        else _need(cfg, "intermediate_size", where),
        heads=heads, kv_heads=heads if mla else int(family.config_value(cfg, "num_key_value_heads") or heads),
        head_dim=(mla["qk_nope"] + mla["qk_rope"] if mla
                  else int(family.config_value(cfg, "head_dim") or hidden // heads)),
        vocab=_need(cfg, "vocab_size", where),
        tied=bool(config.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        # Qwen2 families always have q/k/v biases (Qwen2-MoE's config may say qkv_bias); in the others
        # attention_bias adds them and the o_proj bias
        qkv_bias=attention_bias or (family.qkv_bias and bool(cfg.get("qkv_bias", True))),
        o_bias=not family.qkv_bias and attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),  # only Llama's config has the key
        qk_norm=(family.qk_layernorm if family.qk_norm_key is None
                 else bool(family.config_value(cfg, family.qk_norm_key))),
        experts=experts, expert_ffn=int(family.config_value(cfg, family.moe_ffn_key) or 0) if experts else 0,
        top_k=int(family.config_value(cfg, "num_experts_per_tok") or 0) if experts else 0, moe_layers=moe_layers,
        vision=vision,
        shared_ffn=shared_ffn, shared_gate=family.shared_expert_gate, post_norms=family.post_norms,
        qk_norm_whole=family.qk_norm_whole,
        fused_gate_up=any(pm.layout is Layout.FC1_FUSED for pm in family.layer_params), **mla, **linear, **dsa)


# ---------------------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class TrainerLayout:
    """The trainer settings the memory estimate depends on (all from the flags)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None: TP (Megatron's default)
    bf16: bool = True
    optimizer: str = "adam"
    sequence_parallel: bool = False
    tokens_per_micro_batch: int = 4096  # before the CP split
    micro_batches_in_flight: int | None = None  # None: as 1F1B holds them (pp - stage)
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    gqa_expanded: bool = False  # k/v repeated to the query heads before attention (torch without varlen GQA)
    optimizer_offload: float = 0.0  # --optimizer-cpu-offload's --optimizer-offload-fraction (0: none)
    # each stage's layers under --decoder-first/last-pipeline-num-layers (config/pipeline.py); (): even split
    pipeline_layers: tuple[int, ...] = ()
    lora_rank: int = 0  # --lora-rank (0: the whole model trains)
    lora_targets: tuple[str, ...] = ("all-linear",)  # --lora-target-modules
    mtp_layers: int = 0  # --mtp-num-layers: multi-token-prediction layers on the last stage

    def stage_layers(self, num_layers: int, stage: int) -> tuple[int, int]:
        """(first layer, layer count) of pipeline stage `stage`."""
        if self.pipeline_layers:
            return sum(self.pipeline_layers[:stage]), self.pipeline_layers[stage]
        return stage * (num_layers // self.pp), num_layers // self.pp


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one GPU of the pipeline stage that needs the most."""

    stage: int
    params: int  # parameters held by this GPU
    weights: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    host_optimizer: int = 0  # --optimizer-cpu-offload: host memory of this GPU's rank (not in total)

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits


def activation_bytes_per_token(shape: ModelShape, lay: TrainerLayout, layer: int = 0) -> float:
    """Bytes one layer keeps for backward per token of a micro-batch, without recompute (module docstring)."""
    t, t_sp = lay.tp, lay.tp if lay.sequence_parallel else 1
    kv = shape.q if lay.gqa_expanded else shape.kv
    out = 8 * shape.hidden / t_sp
    if layer in shape.linear_layers:  # a Gated DeltaNet in place of the attention (module docstring)
        nv = shape.lin_value_heads
        kd, vd = shape.lin_key_heads * shape.lin_key_dim, nv * shape.lin_value_dim
        out += (4 * (2 * kd + vd) + 4 * kd + 4 * nv * shape.lin_key_dim + 2 * vd + 6 * nv + 8 * vd) / t
    else:
        out += (2 * (shape.q + 2 * kv) + 2 * shape.q + 4 * shape.heads) / t
        if shape.qk_norm:  # MiniMax-M2's whole-width norms keep the TP-gathered heads
            out += 2 * (shape.q + shape.kv) / (1 if shape.qk_norm_whole else t)
        if shape.output_gate:  # the gate's rows of q_proj, kept for the sigmoid's backward
            out += 2 * shape.q / t
    if shape.post_norms:  # each post norm keeps its input (the projection's output) for its backward
        out += 4 * shape.hidden / t_sp
    if layer in shape.moe_layers:
        out += 8 * shape.top_k * shape.expert_ffn / t + 4 * shape.experts
        out += 8 * shape.shared_ffn / t  # the shared expert's SwiGLU (0 without one)
    else:
        out += 8 * shape.ffn / t
    return out


def stage_activation_bytes(shape: ModelShape, lay: TrainerLayout, stage: int) -> float:
    """Activations one micro-batch leaves on a GPU of pipeline stage `stage`, with the recompute flags."""
    first, per_stage = lay.stage_layers(shape.layers, stage)
    tokens = lay.tokens_per_micro_batch / lay.cp
    layer_bytes = [activation_bytes_per_token(shape, lay, first + i) * tokens for i in range(per_stage)]
    t_sp = lay.tp if lay.sequence_parallel else 1
    layer_input = 2 * shape.hidden * tokens / t_sp
    n = lay.recompute_num_layers or 1
    if lay.recompute_granularity == "full" and lay.recompute_method == "uniform":
        chunks = math.ceil(per_stage / n)
        held = chunks * layer_input + max(sum(layer_bytes[i:i + n]) for i in range(0, per_stage, n))
    elif lay.recompute_granularity == "full" and lay.recompute_method == "block":
        n = min(n, per_stage)
        rest = layer_bytes[n:]
        held = n * layer_input + (sum(rest) if rest else max(layer_bytes))
    elif lay.recompute_granularity == "selective":  # the core attention: only its log-sum-exp goes
        attention = sum(1 for i in range(first, first + per_stage) if i not in shape.linear_layers)
        held = sum(layer_bytes) - attention * 4 * shape.heads / lay.tp * tokens
    else:
        held = sum(layer_bytes)
    if stage == lay.pp - 1:  # final norm: input and output (the LM head's input)
        held += 4 * shape.hidden * tokens / t_sp
    return held


def _stage_params(shape: ModelShape, lay: TrainerLayout, stage: int) -> tuple[int, int]:
    """(dense, expert) parameters on one GPU of pipeline stage `stage`."""
    t = lay.tp
    first, per_stage = lay.stage_layers(shape.layers, stage)
    padded_vocab = -(-shape.vocab // t) * t
    dense = expert = 0
    for i in range(first, first + per_stage):
        split, rep = shape.mixer_params(i)
        dense += split // t + rep
        if i in shape.moe_layers:
            experts, router = shape.moe_params()
            expert += experts // (lay.ep * (lay.etp or t))
            dense += router
            shared_split, shared_rep = shape.shared_expert_params()
            dense += shared_split // t + shared_rep
        else:
            dense += shape.dense_mlp_params() // t
    if stage == 0:
        dense += padded_vocab * shape.hidden // t + (shape.vision.params if shape.vision else 0)
    if stage == lay.pp - 1:
        dense += shape.hidden  # final norm
        if not shape.tied or lay.pp > 1:  # the LM head (a copy of the embedding on the last stage when tied)
            dense += padded_vocab * shape.hidden // t
        for _ in range(lay.mtp_layers):  # an MTP layer: enorm, hnorm, eh_proj [h, 2h], its final norm, a decoder
            # layer (an MoE one in an MoE model: DeepSeek-V3's)
            split, rep = shape.attention_params()
            dense += split // t + rep + 2 * shape.hidden * shape.hidden // t + 3 * shape.hidden
            if shape.experts:
                experts, router = shape.moe_params()
                shared_split, shared_rep = shape.shared_expert_params()
                expert += experts // (lay.ep * (lay.etp or t))
                dense += router + shared_split // t + shared_rep
            else:
                dense += shape.dense_mlp_params() // t
        if lay.mtp_layers and lay.pp > 1:  # the MTP layers' copy of the embedding
            dense += padded_vocab * shape.hidden // t
    return dense, expert


def stage_lora_params(shape: ModelShape, lay: TrainerLayout, stage: int) -> int:
    """LoRA adapter parameters on one GPU of pipeline stage `stage` (0 without LoRA)."""
    if not lay.lora_rank:
        return 0
    first, per_stage = lay.stage_layers(shape.layers, stage)
    total = 0
    for i in range(first, first + per_stage):
        split, rep = shape.lora_params(lay.lora_rank, lay.lora_targets, moe_layer=i in shape.moe_layers)
        total += split // lay.tp + rep
    return total


def lora_params(shape: ModelShape, lay: TrainerLayout) -> int:
    """The whole model's LoRA adapter parameters, unsharded (what --lora-sync adapter sends); 0 without LoRA."""
    if not lay.lora_rank:
        return 0
    return sum(sum(shape.lora_params(lay.lora_rank, lay.lora_targets, moe_layer=i in shape.moe_layers))
               for i in range(shape.layers))


def estimate_memory(shape: ModelShape, lay: TrainerLayout) -> MemoryEstimate:
    """Trainer bytes per GPU (module docstring), for the stage whose total is largest."""
    if shape.layers % lay.pp and not lay.pipeline_layers:
        raise ValueError(f"num_hidden_layers={shape.layers} is not divisible by --pipeline-model-parallel-size "
                         f"{lay.pp}")
    weight_bytes = 2 if lay.bf16 else 4
    # distributed optimizer: fp32 master + Adam m, v (bf16); m, v (fp32); SGD: master and/or momentum
    opt_bytes = {("adam", True): 12, ("adam", False): 8, ("sgd", True): 8, ("sgd", False): 4}[
        (lay.optimizer, lay.bf16)]
    # --optimizer-cpu-offload: that fraction of the shard leaves the GPU; the host holds its fp32 params and
    # grads and the optimizer's states (Adam m, v; SGD momentum) -- megatron-core's HybridDeviceOptimizer
    off = lay.optimizer_offload
    host_bytes = 16 if lay.optimizer == "adam" else 12
    world = lay.tp * lay.pp * lay.cp * lay.dp
    expert_dp = max(1, world // (lay.pp * lay.ep * (lay.etp or lay.tp)))
    best = None
    for stage in range(lay.pp):
        dense, expert = _stage_params(shape, lay, stage)
        in_flight = lay.micro_batches_in_flight or (lay.pp - stage)
        # LoRA: the base is frozen (its weights only: no gradient buffer, master copy or optimizer state); the
        # adapters are the trained parameters, all of them dense (over DP x CP)
        adapters = stage_lora_params(shape, lay, stage)
        trained_dense, trained_expert = (adapters, 0) if lay.lora_rank else (dense, expert)
        est = MemoryEstimate(
            stage=stage, params=dense + expert + adapters, weights=(dense + expert + adapters) * weight_bytes,
            grads=(trained_dense + trained_expert) * 4,
            optimizer=int((1 - off) * opt_bytes * (trained_dense / (lay.dp * lay.cp) + trained_expert / expert_dp)),
            host_optimizer=int(off * host_bytes * (trained_dense / (lay.dp * lay.cp) + trained_expert / expert_dp)),
            activations=int(min(in_flight, lay.pp - stage) * stage_activation_bytes(shape, lay, stage)),
            logits=int(LOGITS_BYTES * lay.tokens_per_micro_batch / lay.cp * (-(-shape.vocab // lay.tp)))
            if stage == lay.pp - 1 else 0)
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best


# ----------------------------------------------------------------------------------- weight sync


@dataclass(frozen=True)
class SyncEstimate:
    bytes: int  # per sync (the vision tower included)
    gbps: float
    link: str  # "intra-node", "inter-node" or "colocated"
    gathered_bytes: int = 0  # what the source ranks first receive from the other TP / EP ranks
    gather_gbps: float = 1.0

    @property
    def gather_seconds(self) -> float:
        return self.gathered_bytes / (self.gather_gbps * 1e9)

    @property
    def seconds(self) -> float:
        return (self.bytes / (self.gbps * 1e9) + self.gather_seconds
                + (0.0 if self.link == "colocated" else SYNC_FIXED_S))


def gathered_params(shape: ModelShape, tp: int, ep: int = 1, etp: int | None = None) -> int:
    """Parameters a sync's source ranks receive from the other trainer ranks before they send: the
    (tp - 1) / tp of every TP-split weight (attention, dense and shared-expert MLPs, embedding and LM head)
    held by the other TP ranks, and the (ep x etp - 1) / (ep x etp) of the routed experts held by the other
    expert-parallel ranks. Norms, routers and the vision tower are whole on every rank."""
    etp = tp if etp is None else etp
    n_moe = len(shape.moe_layers)
    split = (sum(shape.mixer_params(i)[0] for i in range(shape.layers))
             + (shape.layers - n_moe) * shape.dense_mlp_params() + n_moe * shape.shared_expert_params()[0]
             + shape.embedding_params * (1 if shape.tied else 2))
    experts = n_moe * shape.moe_params()[0]
    return round(split * (tp - 1) / tp + experts * (ep * etp - 1) / (ep * etp))


def estimate_sync(shape: ModelShape, bf16: bool, link: str, gbps: float, tp: int = 1, ep: int = 1,
                  etp: int | None = None, gather_gbps: float = 360.0) -> SyncEstimate:
    """Time of one weight sync: the gathers of the TP / EP shards to the source ranks over the node's
    links (`gather_gbps`), then the HF weights in the trainer's dtype over the sync's link, one after the
    other (module docstring)."""
    width = 2 if bf16 else 4
    return SyncEstimate(shape.params * width, COLOCATED_GBPS if link == "colocated" else gbps, link,
                        gathered_params(shape, tp, ep, etp) * width, gather_gbps)
