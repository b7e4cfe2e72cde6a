"""Write a complete tiny HF checkpoint folder, with a tokenizer trained here (no model hub).

    python tools/make_tiny_model.py --out DIR [--arch ARCH] [--seed N]
        [--vocab-size V]

ARCH: qwen2 (default), llama, glm4, qwen3_moe, qwen2_moe, glm4_moe, deepseek_v3, kimi_k2, qwen3_next, qwen3_5,
qwen3_5_moe, qwen2_5_vl, mimo, glm_moe_dsa.
The folder has config.json, model.safetensors, tokenizer.json + tokenizer_config.json (with a ChatML chat template),
generation_config.json. Same seed -> same bytes of weights and the same
tokenizer. The tokenizer uses Qwen2's pre-tokenizer (NFC, Qwen2's split regex, ByteLevel without
its own regex) so that `AutoTokenizer`, which returns `Qwen2Tokenizer` for model_type=qwen2 and
rebuilds the pre-tokenizer, gives the same ids as the trained `tokenizers` object.

Norm weights and q/k/v biases are drawn at random rather than left at 1 and 0: a loader that maps
them wrongly must change the log-probs, or the layout tests would not see it.

`--arch glm4` writes a Glm4ForCausalLM (as GLM-4-9B-0414 / GLM-Z1-9B-0414): q/k/v biases, GQA, half of each
head rotated in interleaved pairs (partial_rotary_factor 0.5), the norms after attention and after the MLP
(post_self_attn_layernorm, post_mlp_layernorm, drawn at random as the other norms), the MLP's gate and up in one
tensor (gate_up_proj), untied embeddings.

`--arch qwen3_moe` writes a Qwen3MoeForCausalLM: every layer a sparse MoE block of
`--num-experts` (8) SwiGLU experts of width `--moe-intermediate-size` (32), top-`--moe-topk` (2)
routing with the top-k probabilities renormalised (norm_topk_prob, as Qwen3-30B-A3B), q/k RMSNorm,
head_dim 16, untied embeddings. The router weights are drawn with std 0.1 (HF's init is 0.02) so
that routing is far from ties: a tie broken differently by two correct implementations would move
a whole expert's output. transformers 5 writes the experts under the hub's per-expert names
(`mlp.experts.{e}.gate_proj.weight` ...) and the expert count as `num_local_experts`.

`--arch qwen2_moe` writes a Qwen2MoeForCausalLM (as Qwen1.5-MoE-A2.7B): q/k/v biases, 3 layers by
default of which `--mlp-only-layers` (1) are dense MLPs, the others sparse MoE blocks of 8 routed
experts, top-2 of the softmax without renormalising (norm_topk_prob false), plus a shared expert of
width `--shared-expert-intermediate-size` (48, unlike the routed experts' 32) scaled by
sigmoid(shared_expert_gate(x)); the gate is drawn with std 0.3 so that its value varies by token.
`--mlp-only-layers` applies to qwen3_moe too (default: none).

`--arch glm4_moe` writes a Glm4MoeForCausalLM (as GLM-4.5): q/k/v biases, q/k norms (use_qk_norm), half of
each head rotated (partial_rotary_factor 0.5), 3 layers by default of which the first
(first_k_dense_replace 1) is dense, the others 8 routed experts chosen by sigmoid scores plus a
random e_score_correction_bias (std 0.05, so a loader that drops it routes differently) in 2 groups
of which 1 is taken (n_group / topk_group: DeepSeek-V3's group-limited routing), top-2, renormalised,
times routed_scaling_factor 2.5, plus one ungated shared expert of the routed experts' width.

`--arch deepseek_v3` writes a DeepseekV3ForCausalLM: glm4_moe's MoE layers (sigmoid routing with the expert
bias in 2 groups, top-2, scaling 2.5, one shared expert, the first layer dense) under multi-latent attention:
the query through a rank-24 pair with its norm (`--q-lora-rank 0`: one projection, as Moonlight), keys and
values expanded per head from a rank-16 latent with its norm, 8 + 4 (rotary, interleaved pairs) query/key
channels and 10 value channels per head, so that no width equals another.

`--arch glm4_moe_lite` writes a Glm4MoeLiteForCausalLM (as GLM-4.7-Flash): deepseek_v3's model (its attention
and MoE widths, one group, scaling 1.8) with its dense layers named twice, as mlp_layer_types (transformers)
and first_k_dense_replace (SGLang).

`--arch glm_moe_dsa` writes a GlmMoeDsaForCausalLM (as GLM-5 / GLM-5.2): deepseek_v3's multi-latent attention
widths and glm4_moe_lite's MoE layout (one group, scaling 2.5, the first layer dense) with DeepSeek Sparse
Attention: every query attends to the 4 keys (index_topk) a lightning indexer of 8 heads of width 8 scores highest,
the first 3 layers running their own indexer and the fourth reusing the third's choice (GLM-5.2's index_topk_freq 2
with index_skip_topk_offset 3; config.json says it as indexer_types too, as transformers writes it), so each
pipeline stage of two starts on a layer with its own indexer. The indexer's projections are drawn with std 0.3 (a
decisive choice, far from ties), its key norm around 1 with a small bias; config.json says indexer_rope_interleave
and rope_interleave (SGLang's readings; transformers always interleaves).

`--arch kimi_k2` writes the deepseek_v3 model under Kimi-K2's model_type (`kimi_k2`; its architecture is
DeepseekV3ForCausalLM, which transformers has no model_type of its own for).

`--arch mimo` writes the qwen2 model untied under MiMo-7B's model_type (`mimo`, which transformers has no classes
for); with `--mtp-layers N` its multi-token-prediction layers under MiMo's names (model.mtp_layers.{k}.*).

`--arch minimax_m2` writes a MiniMaxM2ForCausalLM (as MiniMax-M2.5): GQA without biases, q/k RMSNorms over all
heads' channels together (q_norm [heads x head_dim], k_norm [kv heads x head_dim]), the first rotary_dim 8 of
each head's 16 channels rotated, every layer 8 routed experts of width `--moe-intermediate-size` (config.json's
intermediate_size) chosen by sigmoid scores plus a random e_score_correction_bias (std 0.05), top-2, the chosen
scores renormalised, untied embeddings; config.json carries what SGLang reads (use_qk_norm, qk_norm_type
per_layer, scoring_func sigmoid, use_routing_bias, rotary_dim) and transformers 5 writes the checkpoint under
the hub's names (block_sparse_moe, experts.{e}.w1 / w3 / w2).

`--arch qwen3_next` writes a Qwen3NextForCausalLM (as Qwen3-Next-80B-A3B): 4 layers by default, every second
one full attention (full_attention_interval 2, so that each pipeline stage of two holds both kinds) with its
sigmoid output gate, q/k norms and a quarter of each 16-wide head rotated, the others Gated DeltaNet linear
attention of 2 key heads of width 8 and 4 value heads of width 12 (no width equals another) with a 4-wide
convolution; every layer an MoE block of 8 experts, top-2 renormalised, plus a shared expert of width 48 with its
sigmoid gate. Its RMSNorms are zero-centred (stored w, applied as 1 + w): drawn as 0.1 x N(0, 1); the linear
attention's gated output norm (applied as w) and its dt_bias are drawn around 1 and A_log as transformers does.

`--arch qwen3_5` writes a Qwen3_5ForConditionalGeneration (as Qwen3.5-9B / 27B): qwen3_next's hybrid decoder (4
layers, every second full attention, the same Gated DeltaNet widths, zero-centred norms) with a dense SwiGLU MLP in
every layer and the GatedDeltaNet's in_proj as four tensors (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a); the
decoder under model.language_model., its fields in config.json's text_config, beside a 1-block vision tower (hidden
16, patch 16, merge 2, an 8 x 8 learned position table) under model.visual., as the published checkpoints lay it out.
Heads of width 32 (a quarter rotated: 4 rotary frequencies) with mrope sections [2, 1, 1], so that the interleaved
3-D rotary gives each of time, height and width at least one frequency (and differs from consecutive sections). As
qwen2_5_vl: vocabulary 128 with the vision special tokens, the chat template rendering image parts, and
preprocessor_config.json (Qwen3.5's processor: patch 16, merge 2, mean and std 0.5).

`--arch qwen3_5_moe` writes a Qwen3_5MoeForConditionalGeneration (as Qwen3.5-35B-A3B / Qwen3.6-35B-A3B): qwen3_5's
decoder and vision tower with qwen3_next's MoE block in every layer (8 experts, top-2 renormalised, a shared expert of
width 48 with its sigmoid gate). Its model.safetensors holds transformers' parameters under their own names, as the
published checkpoints do: each layer's routed experts as two tensors, mlp.experts.gate_up_proj [experts, 2 x width,
hidden] and mlp.experts.down_proj [experts, hidden, width] (transformers' save_pretrained would write them one
expert at a time, experts.{e}.gate_proj / up_proj / down_proj).

`--arch qwen2_5_vl` writes a Qwen2_5_VLForConditionalGeneration (a 2-block vision tower, hidden 32,
patch 14, merge 2, one window block and one full-attention block, over the same tiny decoder), the
vision special tokens (<|vision_start|>, <|image_pad|>, ...) in the tokenizer, a chat template that
renders {"type": "image"} parts as Qwen2.5-VL's does, and preprocessor_config.json for the image
processor. No processor_config.json: transformers' Qwen2_5_VLProcessor needs a video processor
(torchvision), so callers build the image processor and the tokenizer separately (FACTS.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from slime_rl.data import vl_counting
from slime_rl.data.digits import corpus_lines

QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
ARCHS = ("qwen2", "llama", "glm4", "qwen3_moe", "qwen2_moe", "glm4_moe", "deepseek_v3", "glm4_moe_lite", "kimi_k2",
         "glm_moe_dsa", "minimax_m2", "qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen2_5_vl", "mimo")
# families transformers runs under another model_type (config/families.py transformers_model_type): the tiny
# model is built as that one and its config.json then names the family's own model_type
BUILT_AS = {"kimi_k2": "deepseek_v3", "mimo": "qwen2"}
VL_ARCHS = ("qwen2_5_vl", "qwen3_5", "qwen3_5_moe")  # vision special tokens, image processor, vocabulary 128
HYBRID = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # Gated DeltaNet and gated attention, zero-centred norms
VL_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2.5-VL's template renders an image part as <|vision_start|><|image_pad|><|vision_end|>; the
# processor then repeats <|image_pad|> once per merged patch. Same rendering here, without tools.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' or 'image' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(vocab_size: int, seed: int, specials: list[str] | None = None,
                    lines: list[str] | None = None) -> Tokenizer:
    specials = SPECIALS if specials is None else specials
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), show_progress=False)
    lines = corpus_lines(seed) if lines is None else lines
    lines += ["<|im_start|>user\n" + ln + "<|im_end|>\n<|im_start|>assistant\n" for ln in lines[:50]]
    tok.train_from_iterator(lines, trainer=trainer)
    tok.add_special_tokens(specials)
    if tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"--vocab-size {vocab_size}: the corpus gives {tok.get_vocab_size()} tokens; "
                         "choose a size the corpus can fill (the alphabet alone is about 40)")
    return tok


def build_config(arch: str, vocab_size: int, eos_id: int, pad_id: int, args: argparse.Namespace):
    common = dict(
        vocab_size=vocab_size, hidden_size=args.hidden_size, intermediate_size=args.hidden_size * 2,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_theta=10000.0, initializer_range=0.02, eos_token_id=eos_id, pad_token_id=pad_id,
        bos_token_id=None, dtype="float32",
    )
    if arch == "qwen2":
        from transformers import Qwen2Config
        return Qwen2Config(tie_word_embeddings=True, use_sliding_window=False, **common)
    if arch == "llama":
        from transformers import LlamaConfig
        return LlamaConfig(tie_word_embeddings=False, attention_bias=False, mlp_bias=False, **common)
    if arch == "glm4":
        from transformers import Glm4Config
        common = {k: v for k, v in common.items() if k != "rope_theta"}
        return Glm4Config(tie_word_embeddings=False, attention_bias=True, hidden_act="silu",
                          head_dim=args.hidden_size // args.num_heads,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.5}, **common)
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        common = {k: v for k, v in common.items() if k != "rope_theta"}
        return Qwen3MoeConfig(tie_word_embeddings=False, attention_bias=False, use_sliding_window=False,
                              head_dim=args.hidden_size // args.num_heads,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                              num_experts=args.num_experts, num_experts_per_tok=args.moe_topk,
                              moe_intermediate_size=args.moe_intermediate_size, norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=list(args.mlp_only_layers or []),
                              router_aux_loss_coef=0.001, output_router_logits=False, **common)
    if arch == "qwen2_moe":
        from transformers import Qwen2MoeConfig
        common = {k: v for k, v in common.items() if k != "rope_theta"}
        return Qwen2MoeConfig(tie_word_embeddings=False, qkv_bias=True, use_sliding_window=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                              num_experts=args.num_experts, num_experts_per_tok=args.moe_topk,
                              moe_intermediate_size=args.moe_intermediate_size, norm_topk_prob=False,
                              shared_expert_intermediate_size=args.shared_expert_intermediate_size,
                              decoder_sparse_step=1, mlp_only_layers=list(args.mlp_only_layers or []),
                              router_aux_loss_coef=0.001, output_router_logits=False, **common)
    if arch == "glm4_moe":
        from transformers import Glm4MoeConfig
        common = {k: v for k, v in common.items() if k != "rope_theta"}
        return Glm4MoeConfig(tie_word_embeddings=False, attention_bias=True, use_qk_norm=True,
                             head_dim=args.hidden_size // args.num_heads,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5},
                             n_routed_experts=args.num_experts, num_experts_per_tok=args.moe_topk,
                             moe_intermediate_size=args.moe_intermediate_size, n_shared_experts=1,
                             norm_topk_prob=True, routed_scaling_factor=2.5, n_group=2, topk_group=1,
                             first_k_dense_replace=len(args.mlp_only_layers or []), num_nextn_predict_layers=0,
                             **common)
    if arch == "deepseek_v3":
        from transformers import DeepseekV3Config
        common = {k: v for k, v in common.items() if k != "rope_theta"}
        return DeepseekV3Config(tie_word_embeddings=False, attention_bias=False, rope_interleave=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                q_lora_rank=args.q_lora_rank or None, kv_lora_rank=16, qk_nope_head_dim=8,
                                qk_rope_head_dim=4, v_head_dim=10, head_dim=4,
                                n_routed_experts=args.num_experts, num_experts_per_tok=args.moe_topk,
                                moe_intermediate_size=args.moe_intermediate_size, n_shared_experts=1,
                                norm_topk_prob=True, routed_scaling_factor=2.5, n_group=2, topk_group=1,
                                first_k_dense_replace=len(args.mlp_only_layers or []), num_nextn_predict_layers=0,
                                **common)
    if arch == "glm4_moe_lite":
        from transformers import Glm4MoeLiteConfig
        common = {k: v for k, v in common.items() if k not in ("rope_theta", "num_key_value_heads")}
        dense = len(args.mlp_only_layers or [])
        cfg = Glm4MoeLiteConfig(tie_word_embeddings=False, attention_bias=False, rope_interleave=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                q_lora_rank=args.q_lora_rank or None, kv_lora_rank=16, qk_nope_head_dim=8,
                                qk_rope_head_dim=4, v_head_dim=10, num_key_value_heads=args.num_heads,
                                n_routed_experts=args.num_experts, num_experts_per_tok=args.moe_topk,
                                moe_intermediate_size=args.moe_intermediate_size, n_shared_experts=1,
                                norm_topk_prob=True, routed_scaling_factor=1.8, n_group=1, topk_group=1,
                                mlp_layer_types=["dense"] * dense + ["sparse"] * (args.num_layers - dense), **common)
        cfg.first_k_dense_replace = dense  # SGLang's name of the same (transformers' class has no such field)
        return cfg
    if arch == "glm_moe_dsa":
        from transformers import GlmMoeDsaConfig
        common = {k: v for k, v in common.items() if k not in ("rope_theta", "num_key_value_heads")}
        dense = len(args.mlp_only_layers or [])
        return GlmMoeDsaConfig(tie_word_embeddings=False, attention_bias=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                               q_lora_rank=args.q_lora_rank or 24, kv_lora_rank=16, qk_nope_head_dim=8,
                               qk_rope_head_dim=4, v_head_dim=10, num_key_value_heads=args.num_heads,
                               n_routed_experts=args.num_experts, num_experts_per_tok=args.moe_topk,
                               moe_intermediate_size=args.moe_intermediate_size, n_shared_experts=1,
                               norm_topk_prob=True, routed_scaling_factor=2.5, n_group=1, topk_group=1,
                               first_k_dense_replace=dense, index_topk=4, index_n_heads=8, index_head_dim=8,
                               index_topk_freq=2, index_skip_topk_offset=3, **common)
    if arch == "minimax_m2":
        from transformers import MiniMaxM2Config
        head_dim = args.hidden_size // args.num_heads
        common = {k: v for k, v in common.items() if k not in ("rope_theta", "intermediate_size")}
        return MiniMaxM2Config(tie_word_embeddings=False, head_dim=head_dim, rotary_dim=head_dim // 2,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                               intermediate_size=args.moe_intermediate_size, num_local_experts=args.num_experts,
                               num_experts_per_tok=args.moe_topk, use_qk_norm=True, qk_norm_type="per_layer",
                               scoring_func="sigmoid", use_routing_bias=True, router_aux_loss_coef=0.001,
                               output_router_logits=False, **common)
    if arch == "qwen3_next":
        from transformers import Qwen3NextConfig
        common = {k: v for k, v in common.items() if k != "rope_theta"}
        return Qwen3NextConfig(tie_word_embeddings=False, attention_bias=False,
                               head_dim=args.hidden_size // args.num_heads,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.25},
                               full_attention_interval=2, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                               linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
                               num_experts=args.num_experts, num_experts_per_tok=args.moe_topk,
                               moe_intermediate_size=args.moe_intermediate_size, norm_topk_prob=True,
                               shared_expert_intermediate_size=args.shared_expert_intermediate_size,
                               decoder_sparse_step=1, mlp_only_layers=list(args.mlp_only_layers or []),
                               router_aux_loss_coef=0.001, output_router_logits=False, **common)
    if arch == "qwen3_5":
        from transformers import Qwen3_5Config
        text = {k: v for k, v in common.items() if k != "rope_theta"}
        text.update(tie_word_embeddings=False, attention_bias=False, head_dim=32,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
                    full_attention_interval=2, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                    linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4)
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=16, spatial_merge_size=2,
                      temporal_patch_size=2, out_hidden_size=args.hidden_size, num_position_embeddings=64)
        return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False, dtype="float32",
                             **_vl_token_fields(args))
    if arch == "qwen3_5_moe":
        from transformers import Qwen3_5MoeConfig
        text = {k: v for k, v in common.items() if k not in ("rope_theta", "intermediate_size")}
        text.update(tie_word_embeddings=False, attention_bias=False, head_dim=32,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
                    full_attention_interval=2, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                    linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
                    num_experts=args.num_experts, num_experts_per_tok=args.moe_topk,
                    moe_intermediate_size=args.moe_intermediate_size,
                    shared_expert_intermediate_size=args.shared_expert_intermediate_size,
                    router_aux_loss_coef=0.001, output_router_logits=False)
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=16, spatial_merge_size=2,
                      temporal_patch_size=2, out_hidden_size=args.hidden_size, num_position_embeddings=64)
        return Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, dtype="float32",
                                **_vl_token_fields(args))
    if arch == "qwen2_5_vl":
        return build_vl_config(common, args)
    raise SystemExit(f"--arch {arch}: unsupported ({', '.join(ARCHS)})")


def _vl_token_fields(args: argparse.Namespace) -> dict:
    ids = args.vl_token_ids
    return {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"]}


def build_vl_config(common: dict, args: argparse.Namespace):
    from transformers import Qwen2_5_VLConfig

    head_dim = args.hidden_size // args.num_heads
    # mrope_section splits head_dim/2 rotary frequencies between t, h and w (Qwen2.5-VL-7B: 16, 24, 24
    # of 64); the same 1:1.5:1.5 shape here so all three axes are exercised.
    half = head_dim // 2
    t = half // 4
    hw = (half - t) // 2
    mrope = [t + (half - t - 2 * hw), hw, hw]
    text = dict(common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
                use_sliding_window=False)
    text.pop("rope_theta")
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, out_hidden_size=args.hidden_size,
                  fullatt_block_indexes=[1], tokens_per_second=2)
    ids = args.vl_token_ids
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                            vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"], dtype="float32")


def make_tiny_model(out: str | Path, arch: str = "qwen2", seed: int = 0, vocab_size: int = 64,
                    hidden_size: int = 64, num_layers: int | None = None, num_heads: int = 4,
                    num_kv_heads: int = 2, num_experts: int = 8, moe_topk: int = 2,
                    moe_intermediate_size: int = 32, shared_expert_intermediate_size: int = 48,
                    mlp_only_layers: list[int] | None = None, q_lora_rank: int = 24,
                    embed_std: float | None = None, mtp_layers: int = 0) -> Path:
    """embed_std: the word embeddings and LM head drawn with this std instead of initializer_range's 0.02 (a
    trained model's scale: with frozen 0.02-std ones the tiny model's logits stay within about +-1.3, which LoRA,
    training only the adapters, cannot widen; the LoRA quickstart's untied llama takes 0.3).
    num_layers: 3 for qwen2_moe and glm4_moe, 4 for qwen3_next, qwen3_5 and qwen3_5_moe, 2 otherwise; mlp_only_layers
    (MoE archs): [1] for qwen2_moe, none for qwen3_moe; glm4_moe's dense layers are the first len(mlp_only_layers)
    (default [0]: first_k_dense_replace 1). mtp_layers (deepseek_v3, glm4_moe_lite, kimi_k2): multi-token-prediction
    layers after the decoder, as DeepSeek-V3's and GLM-4.7-Flash's checkpoints hold them (transformers builds none):
    HF's layer num_layers + k is an MoE decoder layer plus enorm, hnorm, eh_proj [hidden, 2 x hidden] and
    shared_head.norm, and config.json says num_nextn_predict_layers."""
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    family_type, arch = arch, BUILT_AS.get(arch, arch)  # the model_type config.json names; the one built
    first_dense = arch in ("glm4_moe", "deepseek_v3", "glm4_moe_lite", "glm_moe_dsa")  # first_k_dense_replace
    if arch == "glm_moe_dsa" and num_layers is None:
        num_layers = 4
    if num_layers is None:
        num_layers = 3 if arch == "qwen2_moe" or first_dense else 4 if arch in HYBRID else 2
    if mlp_only_layers is None:
        mlp_only_layers = [1] if arch == "qwen2_moe" else [0] if first_dense else []
    if first_dense and mlp_only_layers != list(range(len(mlp_only_layers))):
        raise SystemExit(f"--mlp-only-layers {mlp_only_layers}: {arch}'s dense layers are the first ones "
                         "(first_k_dense_replace)")
    if any(not 0 <= i < num_layers for i in mlp_only_layers):
        raise SystemExit(f"--mlp-only-layers {mlp_only_layers}: layer indices must be in [0, {num_layers})")
    if mtp_layers and arch not in ("deepseek_v3", "glm4_moe_lite") and family_type != "mimo":
        raise SystemExit(f"--mtp-layers {mtp_layers}: only deepseek_v3, glm4_moe_lite, kimi_k2 and mimo checkpoints "
                         "hold multi-token-prediction layers here")
    decoder_layers, num_layers = num_layers, num_layers + mtp_layers  # the MTP layers' decoder layers built too
    args = argparse.Namespace(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                              num_kv_heads=num_kv_heads, num_experts=num_experts, moe_topk=moe_topk,
                              moe_intermediate_size=moe_intermediate_size,
                              shared_expert_intermediate_size=shared_expert_intermediate_size,
                              mlp_only_layers=mlp_only_layers, q_lora_rank=q_lora_rank)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vl = arch in VL_ARCHS
    if vl:
        tok = train_tokenizer(vocab_size, seed, SPECIALS + VL_SPECIALS, vl_counting.corpus_lines(seed))
        args.vl_token_ids = {t: tok.token_to_id(t) for t in VL_SPECIALS}
    else:
        tok = train_tokenizer(vocab_size, seed)
    eos_id, pad_id = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    config = build_config(arch, vocab_size, eos_id, pad_id, args)
    if family_type == "mimo":  # MiMo-7B: Qwen2's layers (q/k/v biases), untied embeddings
        config.tie_word_embeddings = False

    torch.manual_seed(seed)
    if arch == "qwen2_5_vl":  # not an AutoModelForCausalLM: the image-text-to-text class holds the vision tower too
        from transformers import Qwen2_5_VLForConditionalGeneration
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    elif arch == "qwen3_5":  # the hub's class: the decoder under model.language_model., the tower under model.visual.
        from transformers import Qwen3_5ForConditionalGeneration
        model = Qwen3_5ForConditionalGeneration(config).to(torch.float32)
    elif arch == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForConditionalGeneration
        model = Qwen3_5MoeForConditionalGeneration(config).to(torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        zero_centred = arch in HYBRID  # Qwen3NextRMSNorm, Qwen3_5RMSNorm: stored w, applied as 1 + w
        for name, p in model.named_parameters():
            if zero_centred and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight") \
                    and not name.startswith("model.visual."):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("linear_attn.dt_bias"):  # per head, so that a head mapped wrongly shows
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight") or name.endswith("ln_q.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):  # an MoE router: decisive routing (module docstring)
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.shared_expert_gate.weight"):  # Qwen2-MoE: a gate that varies by token
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif ".indexer." in name and name.endswith(("wq_b.weight", "wk.weight", "weights_proj.weight")):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))  # GLM-5's indexer: a decisive choice of keys
            elif embed_std is not None and name.endswith(("embed_tokens.weight", "lm_head.weight")):
                p.copy_(embed_std * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # GLM-4.5 / DeepSeek-V3: a bias that changes routing
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(out, safe_serialization=True)
    if arch == "qwen3_5_moe":  # the published layout: transformers' parameters as they are (module docstring)
        from safetensors.torch import save_file
        save_file({n: t.contiguous() for n, t in model.state_dict().items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
    if arch == "glm_moe_dsa":  # SGLang's readings of the rotary layout, and GLM-5.2's indexer schedule as it says it
        cfg_file = out / "config.json"
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "rope_interleave": True,
                                        "indexer_rope_interleave": True, "index_topk_freq": 2,
                                        "index_skip_topk_offset": 3}, indent=2))
    if family_type != arch:  # the family's own model_type in config.json (Kimi-K2: kimi_k2)
        cfg_file = out / "config.json"
        cfg = {**json.loads(cfg_file.read_text()), "model_type": family_type}
        if family_type == "mimo":  # MiMo-7B's own class name (SGLang's MiMoForCausalLM)
            cfg["architectures"] = ["MiMoForCausalLM"]
        cfg_file.write_text(json.dumps(cfg, indent=2))
    if mtp_layers:
        _add_mtp_tensors(out, decoder_layers, mtp_layers, hidden_size, gen, mimo=family_type == "mimo")

    template = VL_CHAT_TEMPLATE if vl else CHAT_TEMPLATE
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"] + (VL_SPECIALS if vl else []))
    fast.chat_template = template
    fast.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    qwen = arch in ("qwen2", "qwen3_moe", "qwen2_moe", "qwen2_5_vl")  # the others: PreTrainedTokenizerFast
    tok_cfg["tokenizer_class"] = "Qwen2Tokenizer" if qwen else "PreTrainedTokenizerFast"
    tok_cfg["chat_template"] = template
    tok_cfg["model_max_length"] = 512
    cfg_path.write_text(json.dumps(tok_cfg, indent=2))
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, do_sample=True, temperature=1.0,
                     top_p=1.0).save_pretrained(out)
    if vl:
        save_image_processor(out, patch=16 if arch != "qwen2_5_vl" else 14)
    return out


def _add_mtp_tensors(out: Path, decoder_layers: int, mtp_layers: int, hidden: int, gen: torch.Generator,
                     mimo: bool = False) -> None:
    """The last `mtp_layers` decoder layers transformers built become multi-token-prediction layers: their own
    tensors added under HF's names (model.layers.{num_layers + k}.enorm / hnorm / eh_proj / shared_head.norm, as
    DeepSeek-V3's checkpoint and SGLang's NextN loader name them; MiMo's: the layer renamed model.mtp_layers.{k}.,
    with token_layernorm / hidden_layernorm / input_proj / final_layernorm), config.json's num_hidden_layers the
    decoder's and num_nextn_predict_layers theirs."""
    from safetensors.torch import load_file, save_file

    file = out / "model.safetensors"
    tensors = load_file(file)
    for k in range(mtp_layers):
        p = f"model.layers.{decoder_layers + k}."
        own = ("enorm", "hnorm", "shared_head.norm", "eh_proj")
        if mimo:
            tensors = {(f"model.mtp_layers.{k}." + n[len(p):] if n.startswith(p) else n): t for n, t in tensors.items()}
            p, own = f"model.mtp_layers.{k}.", ("token_layernorm", "hidden_layernorm", "final_layernorm", "input_proj")
        for norm in own[:3]:
            tensors[p + norm + ".weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
        tensors[p + own[3] + ".weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=gen)
    save_file(tensors, str(file), metadata={"format": "pt"})
    cfg_file = out / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(num_hidden_layers=decoder_layers, num_nextn_predict_layers=mtp_layers)
    for key in ("mlp_layer_types", "layer_types"):  # one entry per decoder layer (GLM-4.7-Flash's, Qwen2's)
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:decoder_layers]
    cfg_file.write_text(json.dumps(cfg, indent=2))


def save_image_processor(out: Path, patch: int = 14) -> None:
    """preprocessor_config.json for Qwen2.5-VL's image processor (patch 14, merge 2, CLIP mean/std) or Qwen3.5's
    (patch 16, merge 2, mean and std 0.5 per channel).

    min/max pixels are kept small (4 to 64 merged patches) so a tiny model sees short prompts; the
    data flags --min-pixels/--max-pixels override them per run.
    """
    from transformers import Qwen2VLImageProcessorPil

    side = 2 * patch
    half = {} if patch == 14 else {"image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    proc = Qwen2VLImageProcessorPil(min_pixels=4 * side * side, max_pixels=64 * side * side, patch_size=patch,
                                    temporal_patch_size=2, merge_size=2, **half)
    proc.save_pretrained(out)
    cfg_path = out / "preprocessor_config.json"
    cfg = json.loads(cfg_path.read_text())
    # the class AutoImageProcessor resolves from the model type picks the torchvision or the PIL
    # backend by what is installed; a name here would pin it
    cfg["image_processor_type"] = "Qwen2VLImageProcessor"
    cfg_path.write_text(json.dumps(cfg, indent=2))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--arch", choices=ARCHS, default="qwen2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=None,
                   help="default 64 (128 for qwen2_5_vl, qwen3_5 and qwen3_5_moe)")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=None,
                   help="default 3 for qwen2_moe, glm4_moe, deepseek_v3 and glm4_moe_lite, 4 for glm_moe_dsa, "
                        "qwen3_next, qwen3_5 and qwen3_5_moe, 2 otherwise")
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--num-experts", type=int, default=8, help="MoE archs: routed experts per layer")
    p.add_argument("--moe-topk", type=int, default=2, help="MoE archs: experts per token")
    p.add_argument("--moe-intermediate-size", type=int, default=32, help="MoE archs: each expert's width")
    p.add_argument("--shared-expert-intermediate-size", type=int, default=48,
                   help="qwen2_moe: the shared expert's width")
    p.add_argument("--mlp-only-layers", default=None,
                   help="MoE archs: comma-separated dense layers (default 1 for qwen2_moe, none for qwen3_moe, 0 "
                        "for glm4_moe and deepseek_v3, whose dense layers come first)")
    p.add_argument("--q-lora-rank", type=int, default=24,
                   help="deepseek_v3: the query's low rank (0: one query projection, as Moonlight)")
    p.add_argument("--mtp-layers", type=int, default=0,
                   help="deepseek_v3, glm4_moe_lite, kimi_k2, mimo: multi-token-prediction layers after the decoder "
                        "(num_nextn_predict_layers), under HF's names")
    p.add_argument("--embed-std", type=float, default=None,
                   help="the word embeddings' and LM head's std (default: initializer_range, 0.02); the LoRA "
                        "quickstart's model takes 0.3, a trained model's scale, as they do not train")
    a = p.parse_args(argv)
    vocab = a.vocab_size or (128 if a.arch in VL_ARCHS else 64)
    dense = None if a.mlp_only_layers is None else [int(x) for x in a.mlp_only_layers.split(",") if x.strip()]
    out = make_tiny_model(a.out, a.arch, a.seed, vocab, a.hidden_size, a.num_layers, a.num_heads,
                          a.num_kv_heads, a.num_experts, a.moe_topk, a.moe_intermediate_size,
                          a.shared_expert_intermediate_size, dense, a.q_lora_rank, a.embed_std, a.mtp_layers)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
