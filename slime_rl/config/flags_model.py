"""The flag table's rows for slime's MODEL_ARGS: Megatron-LM's model flags, as slime's
scripts/models/*.sh give them (THUDM/slime 624b824a: 39 files, these are every flag they pass but
--attention-softmax-in-fp32, --allgather-cp and the --moe-* flags the trainer section has). The
trainer builds the model from --hf-checkpoint's config.json; these flags describe the same model
in Megatron-LM's terms, so they are kept as given (`ModelConfig.megatron_model_args`, flag name ->
value) and preflight compares each with what the trainer builds from config.json
(trainer/convert/model_args.py): equal is accepted silently, different is refused naming the flag,
both values and the config.json key. Flags with no shape meaning (kernel fusions, grouped GEMM,
YaRN / multi-latent attention settings Megatron-LM reads only with --multi-latent-attention) are
accepted and say why they change nothing here. Types and choices are Megatron-LM's
(megatron/training/arguments.py); no default is filled in, so a flag absent is absent.
"""

from __future__ import annotations

import argparse
import ast
import re
from typing import Any

from slime_rl.config.flag_spec import Flag, _nonneg_float, _nonneg_int, _positive_float, _positive_int, section

MODEL_ARGS_SECTION = "model (slime's MODEL_ARGS, Megatron-LM names): compared with --hf-checkpoint's config.json"
MODEL_ARGS_FIELD = "model.megatron_model_args"
_TO = "is compared with config.json: "
_NONE = "accepted, no effect here: "
_MLA = "multi-latent attention's {what} (deepseek_v3; Megatron-LM reads it only with --multi-latent-attention)"


def moe_freq_type(text: str) -> int | list[int]:
    """Megatron-LM's --moe-layer-freq (arguments.py moe_freq_type): an integer N (layer i is an MoE
    layer when i % N == 0), or a Python list expression of 0/1 per layer such as `([0]*1+[1]*47)`,
    made of digits, commas, brackets, parentheses, + and * only (Megatron-LM evals it after that check;
    here it is evaluated from its syntax tree, nothing else)."""
    text = str(text).strip()
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer N or a list expression such as ([0]*1+[1]*47), "
                                             f"got {text!r}") from None
    if re.search(r"[^,\d\[\]()+*]", text):
        raise argparse.ArgumentTypeError(f"a list expression may hold only digits , [ ] ( ) + *, got {text!r} "
                                         "(slime's scripts join the layers with commas, no spaces)")
    try:
        value = _eval_pattern(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"not a list of layers: {text!r} ({exc})") from None
    if not isinstance(value, list) or not all(isinstance(x, int) for x in value):
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}")
    return value


def _eval_pattern(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_eval_pattern(e) for e in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _eval_pattern(node.left), _eval_pattern(node.right)
        if isinstance(node.op, ast.Mult) and not (isinstance(left, int) or isinstance(right, int)):
            raise ValueError("* needs a number on one side")
        if isinstance(node.op, ast.Mult) and max(left if isinstance(left, int) else 0,
                                                 right if isinstance(right, int) else 0) > 100_000:
            raise ValueError("a repeat count over 100000")
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"{type(node).__name__} is not allowed")


def _shape(name: str, key: str, **kw: Any) -> Flag:
    """A flag compared with config.json (`key`: what it is compared with)."""
    return Flag(name, derived=MODEL_ARGS_FIELD, help=_TO + key, **kw)


def _switch(name: str, key: str) -> Flag:
    return Flag(name, derived=MODEL_ARGS_FIELD, action="store_true", help=_TO + key)


def _refused_switch(name: str, what: str) -> Flag:
    """A feature no family here has: given, it describes another model (compared, always different)."""
    return Flag(name, derived=MODEL_ARGS_FIELD, action="store_true", help=_REFUSED.format(what=what))


def _no_effect(name: str, why: str, **kw: Any) -> Flag:
    return Flag(name, derived=MODEL_ARGS_FIELD, help=_NONE + why, **kw)


def _no_effect_switch(name: str, why: str) -> Flag:
    return Flag(name, derived=MODEL_ARGS_FIELD, action="store_true", help=_NONE + why)


# slime's model files leave these flags out where Megatron-LM's default is the model's value
_ABSENT = "; absent from a whole MODEL_ARGS (with --num-layers, --hidden-size, --num-attention-heads): {default}"
_REFUSED = "refused: no model family here has {what} (a checkpoint of a family with one is refused by its model_type)"

MODEL_FLAGS: tuple[Flag, ...] = section(
    MODEL_ARGS_SECTION,
    # ---- the transformer's size
    _shape('--num-layers', 'num_hidden_layers', type=_positive_int),
    _shape('--hidden-size', 'hidden_size', type=_positive_int),
    _shape('--ffn-hidden-size', "intermediate_size (the dense MLP's width; not compared when every layer is an MoE "
           "layer, where Megatron-LM builds no dense MLP)", type=_positive_int),
    _shape('--num-attention-heads', 'num_attention_heads', type=_positive_int),
    _switch('--group-query-attention', 'num_key_value_heads < num_attention_heads (with --num-query-groups; '
            "without it Megatron-LM's 1 group)" + _ABSENT.format(default="one key/value head per query head")),
    _shape('--num-query-groups', 'num_key_value_heads (Megatron-LM reads it only with --group-query-attention)',
           type=_positive_int),
    _shape('--kv-channels', 'head_dim (without it, hidden_size / num_attention_heads)'
           + _ABSENT.format(default="--hidden-size / --num-attention-heads"), type=_positive_int),
    _shape('--vocab-size', 'vocab_size', type=_positive_int),
    _shape('--max-position-embeddings', 'max_position_embeddings (the engines\' context; --sglang-context-length '
           'sets another)', type=_positive_int),
    _switch('--untie-embeddings-and-output-weights', 'tie_word_embeddings false'
            + _ABSENT.format(default="a tied output layer")),
    _switch('--swiglu', 'hidden_act silu (gated SiLU MLP)'),
    _switch('--disable-bias-linear', "the family's linear layers without bias (every family here; q/k/v biases are "
            "--add-qkv-bias)"),
    _switch('--add-qkv-bias', "the family's q/k/v bias (qwen2, qwen2_moe, qwen2_5_vl, glm4, glm4_moe have it)"
            + _ABSENT.format(default="no q/k/v bias, under --disable-bias-linear")),
    # ---- norms
    Flag('--normalization', derived=MODEL_ARGS_FIELD, choices=('LayerNorm', 'RMSNorm'),
         help=_TO + "the family's norm (RMSNorm for every family here)"),
    _shape('--norm-epsilon', 'rms_norm_eps' + _ABSENT.format(default="1e-05"), type=_positive_float),
    _switch('--qk-layernorm', "the family's q/k norm (qwen3, qwen3_moe have it; glm4_moe where use_qk_norm; "
            "minimax_m2's spans all heads' channels, as slime's MiniMax-M2 spec function builds it)"
            + _ABSENT.format(default="no q/k norm")),
    _switch('--apply-layernorm-1p', "the family's zero-centred norm weights, applied as 1 + w (qwen3_next, "
            "qwen3_5 and qwen3_5_moe have them)" + _ABSENT.format(default="norms that scale by w")),
    _switch('--post-self-attn-layernorm', "the family's norm of the attention's output before its residual add "
            "(glm4 has it: post_self_attn_layernorm)" + _ABSENT.format(default="no norm after attention")),
    _switch('--post-mlp-layernorm', "the family's norm of the MLP's output before its residual add (glm4 has it: "
            "post_mlp_layernorm)" + _ABSENT.format(default="no norm after the MLP")),
    # ---- positions
    Flag('--position-embedding-type', derived=MODEL_ARGS_FIELD,
         choices=('learned_absolute', 'rope', 'yarn', 'mrope', 'relative', 'none'),
         help=_TO + "the family's positions: rope (mrope for qwen2_5_vl; qwen3_5 and qwen3_5_moe: either, as "
         "slime's model files say rope and its qwen3_5_vl provider builds mrope)"),
    _switch('--use-rotary-position-embeddings', "the family's positions (Megatron-LM: --position-embedding-type "
            "rope)"),
    _switch('--no-position-embedding', 'no learned absolute position embedding (true of every family here: they '
            'rotate)'),
    _shape('--rotary-base', 'rope_theta (or rope_parameters.rope_theta)'
           + _ABSENT.format(default="10000 (slime's own config.json check compares it too)"),
           type=_positive_int),
    _shape('--rotary-percent', "partial_rotary_factor (absent: 1.0, the whole head rotates; glm4's and glm4_moe's "
           "transformers default 0.5; minimax_m2: rotary_dim / head_dim)" + _ABSENT.format(default="1.0"),
           type=_positive_float),
    _switch('--rotary-interleaved', "the family's rotary pairs: interleaved (x[0::2], x[1::2]; glm4) or the two "
            "halves of each head (the other families; multi-latent attention interleaves its own way, and "
            "Megatron-LM refuses this flag with it)" + _ABSENT.format(default="the two halves")),
    _refused_switch('--use-rope-scaling', "llama3.x's RoPE scaling: the trainer builds default RoPE (a config.json "
                    "with rope_scaling is refused as such)"),
    _shape('--rotary-scaling-factor', _MLA.format(what="YaRN factor: rope_scaling.factor (1 without YaRN); "
                                                   "llama3.x's scaling is --use-rope-scaling, compared"), type=float),
    _shape('--mscale', _MLA.format(what="YaRN mscale: rope_scaling.mscale"), type=float),
    _shape('--mscale-all-dim', _MLA.format(what="YaRN mscale_all_dim: rope_scaling.mscale_all_dim"), type=float),
    # ---- attention variants
    _switch('--multi-latent-attention', "the family's multi-latent attention (deepseek_v3 has it: kv_lora_rank)"
            + _ABSENT.format(default="standard attention")),
    _shape('--q-lora-rank', _MLA.format(what="query low rank: q_lora_rank (null: one query projection)"),
           type=_positive_int),
    _shape('--kv-lora-rank', _MLA.format(what="key/value latent width: kv_lora_rank"), type=_positive_int),
    _shape('--qk-head-dim', _MLA.format(what="query/key width without positions: qk_nope_head_dim"),
           type=_positive_int),
    _shape('--qk-pos-emb-head-dim', _MLA.format(what="rotary query/key width: qk_rope_head_dim"), type=_positive_int),
    _shape('--v-head-dim', _MLA.format(what="value width: v_head_dim"), type=_positive_int),
    _switch('--attention-output-gate', "the family's sigmoid output gate on attention (qwen3_next, qwen3_5 "
            "and qwen3_5_moe have it: q_proj holds each head's query and gate)"
            + _ABSENT.format(default="no output gate")),
    _switch('--use-gated-attention', "the family's gated attention (slime's name for Qwen3-Next's output gate, read "
            "by its spec; qwen3_next, qwen3_5 and qwen3_5_moe have it)"),
    Flag('--spec', derived=MODEL_ARGS_FIELD, nargs='*', metavar='MODULE FUNCTION',
         help="local, or slime's spec function of the family config.json names (glm4: slime_plugins.models.glm4 "
              "get_glm_spec; minimax_m2: slime_plugins.models.minimax_m2 get_minimax_m2_layer_spec; qwen3_next: "
              "slime_plugins.models.qwen3_next get_qwen3_next_spec; qwen3_5 and qwen3_5_moe: "
              "slime_plugins.models.qwen3_5 get_qwen3_5_spec, or its vision-language provider "
              "slime_plugins.models.qwen3_5_vl get_qwen3_5_vl_model_provider where config.json has a vision_config): "
              "the trainer builds megatron-core's local layer spec of that family (config/families.py, with the "
              "vision tower where it has one), the same model; slime's other spec functions "
              "(slime_plugins.models.*) build families not supported here"),
    Flag('--mtp-num-layers', 'trainer.mtp_num_layers', derived=MODEL_ARGS_FIELD, type=_nonneg_int,
         help="the multi-token-prediction layers the trainer builds after the decoder, at most config.json's "
              "num_nextn_predict_layers (deepseek_v3, glm4_moe_lite, kimi_k2, mimo: megatron-core's MTP block on the "
              "last pipeline stage, loaded from the checkpoint's model.layers.<num_hidden_layers>.* (MiMo's "
              "model.mtp_layers.*), saved in "
              "checkpoints and --save-hf, sent by weight sync); trained only with --enable-mtp-training, else "
              "frozen (absent or 0: none, and the checkpoint's MTP layers stay the engines' as loaded)"),
    # ---- mixture of experts (the trainer's own MoE flags are in the section above)
    _shape('--num-experts', 'num_experts (0: a dense model, as in Megatron-LM)'
           + _ABSENT.format(default="a dense model"), type=_nonneg_int),
    _shape('--moe-router-topk', 'num_experts_per_tok', type=_positive_int),
    _shape('--moe-ffn-hidden-size', 'moe_intermediate_size (minimax_m2: intermediate_size)', type=_positive_int),
    _shape('--moe-shared-expert-intermediate-size', 'shared_expert_intermediate_size (qwen2_moe) or n_shared_experts x '
           'moe_intermediate_size (glm4_moe); absent: no shared expert' + _ABSENT.format(default="no shared expert"),
           type=_positive_int),
    _switch('--moe-shared-expert-gate', "the shared expert's sigmoid gate (qwen2_moe has it)"
            + _ABSENT.format(default="an ungated shared expert")),
    Flag('--moe-layer-freq', derived=MODEL_ARGS_FIELD, type=moe_freq_type, metavar='N_OR_LIST',
         help=_TO + "the MoE layers mlp_only_layers and decoder_sparse_step make (glm4_moe: all after the first "
              "first_k_dense_replace; an integer N: layer i is an MoE "
              "layer when i mod N is 0; a list expression such as ([0]*1+[1]*47): 1 per MoE layer, as Megatron-LM "
              "parses it)"),
    Flag('--moe-router-score-function', derived=MODEL_ARGS_FIELD, choices=('softmax', 'sigmoid', 'sqrtsoftplus'),
         help=_TO + "the family's router: softmax (qwen3_moe, qwen2_moe) or sigmoid (glm4_moe, minimax_m2)"),
    _switch('--moe-router-pre-softmax', 'norm_topk_prob false (softmax over all experts, then the top-k; without '
            'it Megatron-LM takes the softmax over the top-k logits, i.e. norm_topk_prob true); a sigmoid router '
            '(glm4_moe, minimax_m2) does not read it' + _ABSENT.format(default="the softmax after the top-k")),
    _shape('--moe-router-topk-scaling-factor', 'routed_scaling_factor (glm4_moe; 1 for the Qwen MoE families)'
           + _ABSENT.format(default="1"), type=_positive_float),
    _shape('--moe-router-num-groups', 'n_group (glm4_moe; 1 for the Qwen MoE families: all experts at once)'
           + _ABSENT.format(default="1"), type=_positive_int),
    _shape('--moe-router-group-topk', 'topk_group where n_group > 1 (with one group it chooses nothing)',
           type=_positive_int),
    _switch('--moe-router-enable-expert-bias', "the router's e_score_correction_bias (glm4_moe, minimax_m2 have it)"
            + _ABSENT.format(default="no expert bias")),
    Flag('--moe-router-bias-update-rate', derived=MODEL_ARGS_FIELD, type=_nonneg_float,
         check=(lambda v: v == 0, "must be 0: the trainer keeps the checkpoint's expert bias "
                                  "(e_score_correction_bias), which the engines route with; a bias that moved "
                                  "would route the trainer's tokens elsewhere than the engines' (slime's GLM and "
                                  "DeepSeek scripts give 0)"),
         help="0 only: the trainer keeps the checkpoint's expert bias, which the engines route with (slime's GLM "
              "and DeepSeek scripts give 0)"),
    Flag('--moe-router-dtype', derived=MODEL_ARGS_FIELD, choices=('fp32', 'fp64'),
         check=(lambda v: v == 'fp32', "must be fp32: the routers compute in fp32 as the HF model and SGLang do "
                                       "(the trainer's router dtype is fixed), so both sides choose alike"),
         help='fp32 only: the routers compute in fp32 as the HF model and SGLang do (the trainer\'s router dtype '
              'is fixed), so both sides choose alike'),
    _no_effect('--moe-token-drop-policy', 'which tokens an expert over its capacity drops (with '
               "Megatron-LM's --moe-expert-capacity-factor); the trainer's MoE layers are dropless, no token is "
               'dropped either way', choices=('probs', 'position')),
    _no_effect_switch('--moe-permute-fusion', "TransformerEngine's fused token permutation; the local spec "
                      'permutes with torch ops, same result'),
    # ---- kernels and Megatron-LM's own data settings
    _no_effect_switch('--no-rope-fusion', 'always so here: the trainer applies RoPE unfused'),
    _no_effect_switch('--no-masked-softmax-fusion', 'always so here: core attention is torch SDPA '
                      '(trainer/attention.py), no fused masked softmax'),
    _no_effect_switch('--enable-experimental', "Megatron-LM's experimental features; the trainer builds none"),
    _no_effect_switch('--freeze-indexer', "slime's switch that freezes GLM-5's sparse-attention indexer; here it is "
                      'always frozen (trainer/dsa.py: no gradient reaches it, it only chooses keys)'),
    _no_effect('--seq-length', "Megatron-LM's training sequence length (its pretraining data loader's); here each "
               'sample is its prompt + response, bounded by --rollout-max-response-len and the context',
               type=_positive_int),
    _no_effect('--make-vocab-size-divisible-by', 'Megatron-LM pads the embedding and output rows to a multiple of '
               'N x TP; the trainer pads to a multiple of TP, and the padded rows get no probability either way '
               "(log-probs and weight sync use config.json's vocab_size)", type=_positive_int),
)

# accepted without effect; every other flag of MODEL_FLAGS is compared with config.json (preflight)
NO_EFFECT = tuple(f.name for f in MODEL_FLAGS if f.help.startswith(_NONE))
COMPARED = tuple(f.name for f in MODEL_FLAGS if f.name not in NO_EFFECT and f.check is None)


def megatron_model_args(namespace: argparse.Namespace) -> dict[str, Any]:
    """The MODEL_ARGS flags given, by flag name: a switch as True, a value as parsed (--moe-layer-freq an
    int or a list, --spec a list); a flag not given is not in it."""
    out: dict[str, Any] = {}
    for f in MODEL_FLAGS:
        value = getattr(namespace, f.key)
        if value is None or value is False:
            continue
        out[f.name] = value
    return out
