"""Build a megatron-core GPTModel (local layer spec, no TransformerEngine) from an HF config.json.

Every architectural choice comes from config.json through `ModelArch` (convert/arch.py): GQA,
SwiGLU, RMSNorm eps, RoPE base, qkv bias, qk-norm, tied embeddings, head dim. The user only
chooses the dtype and the parallel layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from slime_rl.config.pipeline import stage_layer_counts
from slime_rl.trainer import packed_rope
from slime_rl.trainer.attention import SDPACoreAttention
from slime_rl.trainer.convert import ModelArch, load_arch, with_mtp
from slime_rl.trainer.convert.arch import check_dsa_stages
from slime_rl.trainer.dsa import DSACoreAttention, link_shared_layers
from slime_rl.trainer.gated_delta_net import GatedDeltaNetOutNorm
from slime_rl.trainer.gated_delta_net import install as install_gated_delta_net
from slime_rl.trainer.mcore import (
    ColumnParallelLinear,
    DuplicatedLinear,
    GatedDeltaNet,
    GatedDeltaNetSubmodules,
    GPTModel,
    IdentityOp,
    LocalMLASelfAttention,
    LocalSpecProvider,
    MLATransformerConfig,
    ModuleSpec,
    MultiTokenPredictionBlockSubmodules,
    RowParallelLinear,
    TransformerBlockSubmodules,
    TransformerConfig,
    get_gpt_layer_local_spec,
    get_moe_metrics_tracker,
    get_mtp_layer_spec_for_backend,
    mpu,
)
from slime_rl.trainer.norm import TrainerRMSNorm
from slime_rl.trainer.post_norms import PostNormTransformerLayer
from slime_rl.trainer.vision import InterleavedMultimodalRotaryEmbedding, attach_vision_tower
from slime_rl.trainer.whole_qk_norm import WholeQKNormSelfAttention


@dataclass(frozen=True)
class MoEOptions:
    """The mixture-of-experts knobs the user chooses (Megatron's flag names); the experts, top-k
    and the router's normalisation come from config.json (ModelArch)."""

    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: the TP size (Megatron's default)
    moe_aux_loss_coeff: float = 0.0
    moe_router_load_balancing_type: str = "aux_loss"
    moe_token_dispatcher_type: str = "alltoall"
    moe_grouped_gemm: bool = False  # the local experts as grouped products (trainer/experts.py)


def moe_config_kwargs(arch: ModelArch, moe: MoEOptions, tp_size: int) -> dict:
    """TransformerConfig fields of an MoE model, equal in function to HF's Qwen-MoE block:
    HF takes softmax over all experts (fp32), the top-k, and with norm_topk_prob divides them by
    their sum. Megatron's softmax router with moe_router_pre_softmax=False takes the top-k logits
    and a softmax over those k, which is the same renormalised distribution; with
    pre_softmax=True it takes the top-k of the full softmax, i.e. HF's norm_topk_prob=False.
    The router runs in fp32 (moe_router_dtype) whatever the model's dtype.

    A DeepSeek-style router (glm4_moe: moe_score_function sigmoid) is megatron's sigmoid router with its
    expert_bias added for the choice only, megatron's group-limited top-k, the chosen sigmoid scores
    renormalised (megatron always does for top-k > 1; HF under norm_topk_prob, required) and times
    moe_router_topk_scaling_factor: HF's Glm4MoeTopkRouter / DeepseekV3TopkRouter. The bias is the
    checkpoint's and stays it (moe_router_bias_update_rate 0, as slime's GLM and DeepSeek scripts set):
    the engine routes with the same bias, so the trainer must too."""
    if arch.num_experts == 0:
        return {}
    common = dict(
        num_moe_experts=arch.num_experts,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_topk=arch.moe_topk,
        moe_router_dtype="fp32",
        moe_aux_loss_coeff=moe.moe_aux_loss_coeff,
        moe_router_load_balancing_type=moe.moe_router_load_balancing_type,
        moe_token_dispatcher_type=moe.moe_token_dispatcher_type,
        moe_grouped_gemm=False,  # megatron's TE grouped GEMM; --moe-grouped-gemm is trainer/experts.py's instead
        expert_model_parallel_size=moe.expert_model_parallel_size,
        expert_tensor_parallel_size=moe.expert_tensor_parallel_size or tp_size,
    )
    if arch.moe_score_function == "sigmoid":
        return dict(common, moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                    moe_router_enable_expert_bias=arch.moe_expert_bias, moe_router_bias_update_rate=0.0,
                    moe_router_num_groups=arch.moe_num_groups or None,
                    moe_router_group_topk=arch.moe_group_topk or None,
                    moe_router_topk_scaling_factor=arch.moe_scaling_factor)
    if arch.moe_topk == 1 and arch.moe_norm_topk_prob:
        raise ValueError("num_experts_per_tok=1 with norm_topk_prob=true: every token's weight is 1 and the "
                         "router gets no gradient (megatron refuses it: --moe-router-pre-softmax)")
    return dict(common, moe_router_score_function="softmax", moe_router_pre_softmax=not arch.moe_norm_topk_prob)


def moe_block_kwargs(arch: ModelArch) -> dict:
    """TransformerConfig fields of the MoE block's layout: the shared expert of Qwen2-MoE
    (megatron's SharedExpertMLP of moe_shared_expert_intermediate_size; with moe_shared_expert_gate
    it multiplies its output by sigmoid(x . gate_weight), gate_weight [1, hidden]: HF's
    `sigmoid(shared_expert_gate(x)) * shared_expert(x)`, added to the routed experts' output as HF
    does), and the dense layers of a mixed model as megatron's per-layer pattern (moe_layer_freq as
    a list: 1 = MoE block, 0 = dense MLP of ffn_hidden_size)."""
    out: dict = {}
    if not arch.num_experts:
        return out
    if arch.moe_shared_expert_ffn_hidden_size:
        out.update(moe_shared_expert_intermediate_size=arch.moe_shared_expert_ffn_hidden_size,
                   moe_shared_expert_gate=arch.family.shared_expert_gate, moe_shared_expert_overlap=False)
    if arch.moe_layers and not all(arch.moe_layers):
        out["moe_layer_freq"] = [int(m) for m in arch.moe_layers]
    return out


def moe_aux_losses(config, num_microbatches: int) -> dict[str, float]:
    """The load-balancing losses megatron's routers recorded since the last call, as Megatron-LM
    logs them: per layer summed over micro-batches and divided by their number, reduced over the
    router's group (TP x CP) and PP, averaged over DP, then averaged over the MoE layers; the
    tracker is cleared. Every rank of the model must call it (collectives). {} for a dense model
    or when no aux loss is on (--moe-aux-loss-coeff 0)."""
    if not getattr(config, "num_moe_experts", None):
        return {}
    coeff = config.moe_aux_loss_coeff
    if not (sum(coeff) if isinstance(coeff, list) else coeff):
        return {}
    tracker = get_moe_metrics_tracker()
    names = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
             "global_aux_loss": "global_load_balancing_loss"}
    types = config.moe_router_load_balancing_type
    track = [names[t] for t in (types if isinstance(types, list) else [types]) if t in names]
    totals: dict = {}
    tracker.report(loss_scale=1.0 / num_microbatches, iteration=0, force_initialize=True, track_names=track,
                   num_layers=config.num_layers, total_loss_dict=totals,
                   moe_layer_freq=config.moe_layer_freq)  # averaged over the MoE layers only
    return {f"moe/{k}": float(v) for k, v in totals.items()}


def transformer_config(arch: ModelArch, *, bf16: bool, tp_size: int, pp_size: int,
                       use_cpu_initialization: bool, sequence_parallel: bool = False,
                       recompute_granularity: str | None = None, recompute_method: str | None = None,
                       recompute_num_layers: int | None = None, context_parallel_size: int = 1,
                       moe: MoEOptions | None = None, deterministic_mode: bool = False,
                       mtp_loss_scaling_factor: float = 0.2):
    """megatron TransformerConfig equal in function to the HF model (dropout off: RL log-probs
    of the trainer must equal the engine's). `sequence_parallel` needs tp_size > 1 (megatron
    asserts it); recompute_* are megatron's activation-recomputation knobs, passed through;
    `moe`: the MoE options of a mixture-of-experts arch (moe_config_kwargs); the multi-token-prediction
    layers (arch.mtp_built) with their loss's factor (--mtp-loss-scaling-factor) and detached heads (below)."""
    if sequence_parallel and tp_size == 1:
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    dtype = torch.bfloat16 if bf16 else torch.float32
    moe_kwargs = moe_config_kwargs(arch, moe or MoEOptions(), tp_size)
    moe_kwargs.update(moe_block_kwargs(arch))  # shared expert, dense layers
    if moe_kwargs.get("moe_token_dispatcher_type") == "allgather" and pp_size > 1:
        raise ValueError("--moe-token-dispatcher-type allgather: megatron's allgather dispatcher does not take "
                         "variable sequence lengths, which pipeline stages exchange here (packed micro-batches "
                         "differ in length); use alltoall with --pipeline-model-parallel-size > 1")
    uneven = {}
    if arch.pipeline_layers:  # megatron's uneven split: the first and last stages' counts, the rest even
        uneven = {"num_layers_in_first_pipeline_stage": arch.pipeline_layers[0],
                  "num_layers_in_last_pipeline_stage": arch.pipeline_layers[-1]}
    mla = {}
    config_class = TransformerConfig
    if arch.mla:  # megatron's MLASelfAttention: its own fields, default RoPE on the rotary part of each head
        config_class = MLATransformerConfig
        mla = dict(q_lora_rank=arch.q_lora_rank or None, kv_lora_rank=arch.kv_lora_rank,
                   qk_head_dim=arch.qk_nope_head_dim, qk_pos_emb_head_dim=arch.qk_rope_head_dim,
                   v_head_dim=arch.v_head_dim, rope_type="rope", rotary_base=arch.rotary_base,
                   rotary_percent=1.0, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
        if arch.yarn_factor:  # YaRN on the rotary channels (convert/arch.py _yarn_fields: transformers' reading)
            mla.update(rope_type="yarn", rotary_scaling_factor=arch.yarn_factor,
                       original_max_position_embeddings=arch.yarn_original_max_position_embeddings,
                       beta_fast=arch.yarn_beta_fast, beta_slow=arch.yarn_beta_slow, mscale=arch.yarn_mscale,
                       mscale_all_dim=arch.yarn_mscale_all_dim)
    hybrid = {}
    if arch.linear_layers:  # Qwen3-Next: megatron's GatedDeltaNet in the linear-attention layers (the layer spec's)
        hybrid = dict(experimental_attention_variant="gated_delta_net",
                      linear_attention_freq=[int(x) for x in arch.linear_layers],
                      linear_conv_kernel_dim=arch.linear_conv_kernel_dim,
                      linear_key_head_dim=arch.linear_key_head_dim, linear_value_head_dim=arch.linear_value_head_dim,
                      linear_num_key_heads=arch.linear_num_key_heads,
                      linear_num_value_heads=arch.linear_num_value_heads)
    mtp = {}
    if arch.mtp_built:
        # mtp_detach_heads: the MTP loss trains the MTP layers alone, as slime's Megatron does (its patch detaches the
        # embedding, the decoder's hidden state and the output weight): the decoder, the embedding and the output
        # layer get no gradient from it
        mtp = dict(mtp_num_layers=arch.mtp_built, mtp_loss_scaling_factor=mtp_loss_scaling_factor,
                   mtp_detach_heads=True)
    config = config_class(
        **uneven,
        **mtp,
        **mla,
        **hybrid,
        # Qwen3-Next: the full attention's sigmoid output gate, RMSNorms that scale by 1 + w
        attention_output_gate=arch.attention_output_gate,
        layernorm_zero_centered_gamma=arch.zero_centered_norms,
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        # MiniMax-M2's whole-width q/k norms are their own modules (trainer/whole_qk_norm.py), not megatron's
        qk_layernorm=arch.qk_layernorm and not arch.qk_norm_whole,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # the fused kernels are CUDA-only (and the unfused path is what the CPU tests check)
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        rotary_interleaved=arch.rotary_interleaved,  # GLM-4: pairs (x[0::2], x[1::2]) as transformers' Glm4 rotates
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        context_parallel_size=context_parallel_size,  # done by SDPACoreAttention (attention.py)
        sequence_parallel=sequence_parallel,
        recompute_granularity=recompute_granularity,
        recompute_method=recompute_method,
        recompute_num_layers=recompute_num_layers,
        params_dtype=dtype,
        bf16=bf16,
        # p2p activation buffers between pipeline stages are allocated in this dtype
        pipeline_dtype=dtype,
        # packed (THD) micro-batches differ in length: stages exchange shapes before tensors
        variable_seq_lengths=pp_size > 1,
        use_cpu_initialization=use_cpu_initialization,
        deterministic_mode=deterministic_mode,  # --deterministic-mode: megatron's deterministic code paths
        # weights come from the HF checkpoint right after; skip the random init work
        perform_initialization=False,
        # dense models too: megatron rejects variable_seq_lengths with its default ("allgather")
        # MoE token dispatcher even without experts
        **{"moe_token_dispatcher_type": "alltoall", **moe_kwargs},
    )
    if arch.dsa_index_topk:  # DeepSeek Sparse Attention's settings, read by trainer/dsa.py's core attention
        config.slime_rl_dsa = {"index_topk": arch.dsa_index_topk, "index_heads": arch.dsa_index_heads,
                               "index_head_dim": arch.dsa_index_head_dim, "indexer_layers": arch.dsa_indexer_layers}
    return config


def build_gpt_model(arch: ModelArch, *, bf16: bool = False, tp_size: int = 1, pp_size: int = 1,
                    pre_process: bool | None = None, post_process: bool | None = None,
                    sequence_parallel: bool = False, recompute_granularity: str | None = None,
                    recompute_method: str | None = None, recompute_num_layers: int | None = None,
                    context_parallel_size: int = 1, fp32_lm_head: bool = False, moe: MoEOptions | None = None,
                    deterministic_mode: bool = False, mtp_loss_scaling_factor: float = 0.2):
    """A GPTModel for this rank (parallel state must be initialized). Its logits are vocab-parallel
    ([b, s, padded_vocab / tp]); its parameters are uninitialized until `hf_io.load_hf_weights`.
    pre_process / post_process default to whether this rank is the first / last pipeline stage;
    with PP, megatron gives each stage its consecutive layers (named from 0 locally): num_layers / pp, or
    arch.pipeline_layers' counts (--decoder-first/last-pipeline-num-layers). The multi-token-prediction layers
    (arch.mtp_built) are megatron's MultiTokenPredictionBlock on the last stage (`_mtp_block_spec`), run only by
    the forwards that train them (MTPGPTModel)."""
    packed_rope.install()  # packed THD RoPE without per-sample host syncs (see packed_rope.py)

    first_layer, here = arch.stage_layers(mpu.get_pipeline_model_parallel_rank() if pp_size > 1 else 0, pp_size)
    if arch.dsa_indexer_layers and pp_size > 1:  # a shared indexer layer's source on the same stage
        check_dsa_stages(arch.dsa_indexer_layers, [arch.stage_layers(r, pp_size)[0] for r in range(pp_size)])
    if pre_process is None:
        pre_process = mpu.is_pipeline_first_stage(ignore_virtual=True)
    if post_process is None:
        post_process = mpu.is_pipeline_last_stage(ignore_virtual=True)
    config = transformer_config(arch, bf16=bf16, tp_size=tp_size, pp_size=pp_size,
                                use_cpu_initialization=not torch.cuda.is_available(),
                                sequence_parallel=sequence_parallel,
                                recompute_granularity=recompute_granularity,
                                recompute_method=recompute_method, recompute_num_layers=recompute_num_layers,
                                context_parallel_size=context_parallel_size, moe=moe,
                                deterministic_mode=deterministic_mode,
                                mtp_loss_scaling_factor=mtp_loss_scaling_factor)
    spec = _layer_spec(arch, arch.num_experts or None, grouped=bool(moe and moe.moe_grouped_gemm))
    # every norm ours (engine rounding; SP-capable): trainer/norm.py
    spec = _norm_block_spec(spec, arch, here)
    if not all(arch.is_moe_layer(i) for i in range(arch.num_layers)) and arch.num_experts:
        spec = _mixed_block_spec(spec, arch, first_layer, here)
    if arch.linear_layers:  # Qwen3-Next: GatedDeltaNet in the linear-attention layers
        install_gated_delta_net()  # torch in place of flash-linear-attention where fla is not installed
        spec = _hybrid_block_spec(spec, arch, first_layer)
    if arch.mrope_section is not None:  # vision-language: 3-D positions (trainer/vision.py)
        config.mrope_section = list(arch.mrope_section)
    mtp = {}
    if arch.mtp_built and post_process:
        mtp["mtp_block_spec"] = _mtp_block_spec(arch, grouped=bool(moe and moe.moe_grouped_gemm))
    model = (MTPGPTModel if arch.mtp_built else GPTModel)(
        **mtp,
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="mrope" if arch.mrope_section is not None else "rope",
        rotary_base=arch.rotary_base,
        rotary_percent=arch.rotary_percent,
    )
    if arch.mrope_interleaved:  # Qwen3.5: interleaved sections, which megatron's MultimodalRotaryEmbedding lacks
        model.rotary_pos_emb = InterleavedMultimodalRotaryEmbedding(
            arch.kv_channels, arch.rotary_percent, arch.rotary_base,
            device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
    if arch.vision is not None and pre_process:
        attach_vision_tower(model, arch)
    if arch.dsa_indexer_layers:
        link_shared_layers(model)
    if bf16 and post_process and fp32_lm_head:
        fp32_output_layer(model.output_layer)
        # the fp32 output layer's GEMMs on tensor cores (TF32) rather than the fp32 pipes (~6x slower; they
        # were 45% of a SmolLM2 train step's kernel time on an H200): its forward operands are bf16 values,
        # which TF32's 10-bit mantissa holds exactly, and TF32 accumulates in fp32, so the logits are
        # those of the fp32 GEMM up to summation order (the engine's bf16 x bf16 -> fp32 GEMM alike); only
        # the backward's fp32 logit gradient is rounded (to 10 bits, finer than a bf16 layer's 7). In a
        # bf16 model every other matmul is bf16, so the process-wide setting touches nothing else.
        torch.set_float32_matmul_precision("high")
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


class MTPGPTModel(GPTModel):
    """megatron's GPTModel with multi-token-prediction layers that run only in the forwards that train them:
    `mtp_train` True (steps.model_forward sets it per forward, with the loss_mask of the tokens whose MTP
    prediction counts). Otherwise (forward-only log-probs, --mtp-num-layers without --enable-mtp-training) the
    model is the decoder alone, as slime's Megatron skips its MTP block without mtp_labels: megatron-core 0.19
    would run it in every forward and take a loss over all tokens."""

    mtp_train = False

    def _postprocess(self, *args, mtp_in_postprocess=None, **kwargs):  # noqa: ANN001 - megatron's signature
        if self.mtp_train:
            return super()._postprocess(*args, mtp_in_postprocess=mtp_in_postprocess, **kwargs)
        n = self.config.mtp_num_layers
        self.config.mtp_num_layers = None  # megatron reads it here to split the hidden states and take the loss
        try:
            return super()._postprocess(*args, mtp_in_postprocess=False, **kwargs)
        finally:
            self.config.mtp_num_layers = n


def _mtp_block_spec(arch: ModelArch, grouped: bool = False) -> MultiTokenPredictionBlockSubmodules:
    """megatron's multi-token-prediction block under the local spec: each layer's enorm, hnorm and final norm ours
    (trainer/norm.py), eh_proj a column-parallel linear, and the decoder layer an MoE layer of this model (a dense
    one for a dense model): DeepSeek-V3's MTP layer, as HF's checkpoint and SGLang's draft model hold it."""
    layer = _layer_spec(arch, arch.num_experts or None, grouped=grouped)
    layer = _norm_block_spec(layer, arch, 1).layer_specs[0]
    spec = get_mtp_layer_spec_for_backend(layer, LocalSpecProvider())
    spec = dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, enorm=TrainerRMSNorm, hnorm=TrainerRMSNorm, layer_norm=TrainerRMSNorm))
    return MultiTokenPredictionBlockSubmodules(layer_specs=[spec] * arch.mtp_built)


def fp32_output_layer(layer: torch.nn.Module) -> None:
    """Logits in fp32 from the bf16 hidden state and bf16 (possibly tied) weight, as SGLang's
    `--enable-fp32-lm-head` and the built-in engine compute them: bf16 logits of magnitude ~20
    carry rounding errors of ~0.06, which alone put |trainer - engine| log-prob gaps at ~1e-2.
    Wraps the layer's linear function (megatron's autograd Function), so TP/SP communication and
    the backward stay megatron's; the weight's grad flows back through the cast to the bf16 param."""
    inner = layer._forward_impl

    def forward_impl(input, weight, *args, **kwargs):  # noqa: A002 - megatron's keyword name
        return inner(input.float(), weight.float(), *args, **kwargs)

    layer._forward_impl = forward_impl


def _layer_spec(arch: ModelArch, num_experts: int | None, grouped: bool = False):
    """megatron's local layer spec for this arch (multi-latent attention where the family has it) with our
    core attention: megatron's local DotProductAttention rejects packed (THD) batches; ours handles both.
    `grouped` (--moe-grouped-gemm): the MoE layer's local experts as trainer/experts.py's GroupedExperts."""
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm",
                                    qk_layernorm=arch.qk_layernorm and not arch.qk_norm_whole,
                                    multi_latent_attention=arch.mla)
    spec.submodules.self_attention.submodules.core_attention = DSACoreAttention if arch.dsa_index_topk \
        else SDPACoreAttention  # sparse attention (glm_moe_dsa): MLA's keys chosen by an indexer (trainer/dsa.py)
    if arch.qk_norm_whole:  # MiniMax-M2: q/k norms over all heads' channels (trainer/whole_qk_norm.py)
        spec.submodules.self_attention.module = WholeQKNormSelfAttention
    if grouped and num_experts:  # the MoE layer's builder (a partial of MoELayer) with GroupedExperts for experts
        import dataclasses
        import functools

        from slime_rl.trainer.experts import GroupedExperts

        moe_layer = spec.submodules.mlp
        subs = moe_layer.keywords["submodules"]
        experts = functools.partial(GroupedExperts, *subs.experts.args, **subs.experts.keywords)
        spec.submodules.mlp = functools.partial(moe_layer.func, *moe_layer.args, **{
            **moe_layer.keywords, "submodules": dataclasses.replace(subs, experts=experts)})
    if arch.mla:  # the latent down projections whole on every TP rank (mcore.DuplicatedLinear says why)
        spec.submodules.self_attention.module = LocalMLASelfAttention
        spec.submodules.self_attention.submodules.linear_q_down_proj = DuplicatedLinear
        spec.submodules.self_attention.submodules.linear_kv_down_proj = DuplicatedLinear
    return spec


def _norm_block_spec(spec, arch: ModelArch, layers_here: int):
    """The local layer spec with our norms (trainer/norm.py: the engine's rounding, SP-capable), as a
    block spec so the final norm is ours too."""
    spec.submodules.input_layernorm = TrainerRMSNorm
    spec.submodules.pre_mlp_layernorm = TrainerRMSNorm
    if arch.post_norms:  # GLM-4's norms after attention and after the MLP (trainer/post_norms.py)
        spec.module = PostNormTransformerLayer
    if arch.mla:  # the query's and the key/value latent's norms (q_layernorm only with q_lora_rank)
        spec.submodules.self_attention.submodules.q_layernorm = TrainerRMSNorm if arch.q_lora_rank else IdentityOp
        spec.submodules.self_attention.submodules.kv_layernorm = TrainerRMSNorm
    elif arch.qk_layernorm and not arch.qk_norm_whole:  # see the gathered sequence; megatron sums their grads anyway
        spec.submodules.self_attention.submodules.q_layernorm = TrainerRMSNorm
        spec.submodules.self_attention.submodules.k_layernorm = TrainerRMSNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * layers_here, layer_norm=TrainerRMSNorm)


def _mixed_block_spec(moe_spec, arch: ModelArch, first: int, layers_here: int):
    """A block spec of an MoE model with dense layers (mlp_only_layers / decoder_sparse_step): this
    stage's layers, each the MoE layer spec or the dense one (megatron's own
    get_gpt_decoder_block_spec does the same from moe_layer_freq, with its own norms and attention)."""
    dense = _layer_spec(arch, None)
    # moe_spec is already the block spec of _norm_block_spec
    moe_layer, norm = moe_spec.layer_specs[0], moe_spec.layer_norm
    dense = _norm_block_spec(dense, arch, 1).layer_specs[0]
    specs = [moe_layer if arch.is_moe_layer(first + i) else dense for i in range(layers_here)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm)


def _hybrid_block_spec(block, arch: ModelArch, first: int):
    """The block spec with megatron's GatedDeltaNet as the attention of the linear-attention layers (config.json's
    layer_types), under the local spec: its in_proj column-parallel, its out_proj row-parallel, its output norm
    gated_delta_net.GatedDeltaNetOutNorm; the input norm stays the layer's own (TE's spec fuses it into in_proj)."""
    gdn = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=GatedDeltaNetOutNorm, out_proj=RowParallelLinear))
    specs = []
    for i, layer in enumerate(block.layer_specs):
        if arch.is_linear_layer(first + i):
            layer = dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=gdn))
        specs.append(layer)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=block.layer_norm)


def build_from_checkpoint(hf_checkpoint: str | Path, *, bf16: bool = False, tp_size: int = 1,
                          pp_size: int = 1, pad_vocab_multiple: int = 1, decoder_first: int | None = None,
                          decoder_last: int | None = None, mtp_num_layers: int | None = None, **model_kwargs):
    """(arch, model) for an HF folder; weights are not loaded yet. `decoder_first` / `decoder_last`:
    --decoder-first/last-pipeline-num-layers (config/pipeline.py; None: the even split); `mtp_num_layers`:
    --mtp-num-layers (convert/arch.py with_mtp); model_kwargs go to `build_gpt_model` (sequence_parallel,
    recompute_*)."""
    arch = load_arch(hf_checkpoint, tp_size, pad_vocab_multiple)
    arch = with_mtp(arch, mtp_num_layers, where=f"{hf_checkpoint}/config.json")
    arch = with_pipeline_split(arch, pp_size, decoder_first, decoder_last)
    return arch, build_gpt_model(arch, bf16=bf16, tp_size=tp_size, pp_size=pp_size, **model_kwargs)


def with_pipeline_split(arch: ModelArch, pp_size: int, decoder_first: int | None = None,
                        decoder_last: int | None = None) -> ModelArch:
    """The arch with its stages' layer counts when --decoder-first/last-pipeline-num-layers make the split
    uneven (ValueError naming the flags when they do not split the layers); unchanged otherwise."""
    if decoder_first is None and decoder_last is None:
        return arch
    counts = stage_layer_counts(arch.num_layers, pp_size, decoder_first, decoder_last)
    return dataclasses.replace(arch, pipeline_layers=counts) if len(set(counts)) > 1 else arch


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel under DDP / Float16Module wrappers (they all hold it as `.module`)."""
    while hasattr(model, "module"):
        model = model.module
    return model
