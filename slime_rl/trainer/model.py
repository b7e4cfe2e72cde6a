"""Build a megatron-core GPTModel (local layer spec, no TransformerEngine) from an HF config.json.

Every architectural choice comes from config.json through `ModelArch` (convert/arch.py): GQA,
SwiGLU, RMSNorm eps, RoPE base, qkv bias, qk-norm, tied embeddings, head dim. The user only
chooses the dtype and the parallel layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from slime_rl.trainer.convert import ModelArch, load_arch


def transformer_config(arch: ModelArch, *, bf16: bool, tp_size: int, pp_size: int,
                       use_cpu_initialization: bool):
    """megatron TransformerConfig equal in function to the HF model (dropout off: RL log-probs
    of the trainer must equal the engine's)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    return TransformerConfig(
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
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # the fused kernels are CUDA-only (and the unfused path is what the CPU tests check)
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        sequence_parallel=False,
        params_dtype=dtype,
        bf16=bf16,
        pipeline_dtype=dtype,
        use_cpu_initialization=use_cpu_initialization,
        # weights come from the HF checkpoint right after; skip the random init work
        perform_initialization=False,
    )


def build_gpt_model(arch: ModelArch, *, bf16: bool = False, tp_size: int = 1, pp_size: int = 1,
                    pre_process: bool = True, post_process: bool = True):
    """A GPTModel for this rank (parallel state must be initialized). Its logits are vocab-parallel
    ([b, s, padded_vocab / tp]); its parameters are uninitialized until `hf_io.load_hf_weights`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(arch, bf16=bf16, tp_size=tp_size, pp_size=pp_size,
                                use_cpu_initialization=not torch.cuda.is_available())
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_layernorm)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rotary_base,
        rotary_percent=1.0,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def build_from_checkpoint(hf_checkpoint: str | Path, *, bf16: bool = False, tp_size: int = 1,
                          pp_size: int = 1, pad_vocab_multiple: int = 1):
    """(arch, model) for an HF folder; weights are not loaded yet."""
    arch = load_arch(hf_checkpoint, tp_size, pad_vocab_multiple)
    return arch, build_gpt_model(arch, bf16=bf16, tp_size=tp_size, pp_size=pp_size)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel under DDP / Float16Module wrappers (they all hold it as `.module`)."""
    while hasattr(model, "module"):
        model = model.module
    return model
