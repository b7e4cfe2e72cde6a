"""One record per model family, keyed by HF `model_type`: what every room needs to know of it.

The trainer's converters read the explicit name tables HF <-> Megatron (`global_params`,
`layer_params`) and the features (`qkv_bias`, `qk_layernorm`, `moe`, `shared_expert`, `vision`);
the memory estimate (`orchestration/estimate.py`) reads the same features; the built-in engine reads
`moe` (which checkpoints return routed experts) and `hf_rmsnorm` (which RMSNorm modules its compiled
decode step may replace). Adding a family is a `Family` here, plus its tiny checkpoint in
`tools/make_tiny_model.py` for the tests (tests/trainer/test_families.py checks both).

Megatron names are those of megatron-core 0.19's GPTModel with the *local* layer spec (no
TransformerEngine): norms are separate modules (`input_layernorm.weight`,
`pre_mlp_layernorm.weight`), not fused into the linear (`linear_qkv.layer_norm_weight` is the TE
spec's name). Each entry says how the tensor is laid out over tensor-parallel ranks (`Layout`);
the tensor math lives in `shards.py`. No dispatch by substring: a family lists every parameter.

Mixture-of-experts families (`Family.moe`) use megatron-core 0.19's MoELayer under the local spec:
the router is `mlp.router.weight` ([experts, hidden], whole on every rank) and the routed experts
are SequentialMLP's `mlp.experts.local_experts.{e}.linear_fc1/fc2.weight`, one MLP per expert
(TEGroupedMLP's `weight1` / `weight2` need TransformerEngine). An expert entry (`ParamMap.expert`)
carries "{e}": in the Megatron name the expert's index on its expert-parallel rank, in the HF
names the global index (EP rank x local experts + local index), and it is split over the
expert-tensor-parallel group (ETP) rather than TP. Qwen2-MoE's shared expert is megatron's
SharedExpertMLP (`mlp.shared_experts.linear_fc1/fc2.weight`, split over TP like a dense MLP) with its
sigmoid gate `mlp.shared_experts.gate_weight` [1, hidden] (sigmoid(x . w) times the shared expert's
output, added to the routed experts': HF's `shared_expert_gate` exactly). A family whose config
makes some layers dense (mlp_only_layers, decoder_sparse_step) lists those layers' entries in
`Family.dense_layer_params` (megatron builds a dense MLP there: moe_layer_freq as a list).

GLM-4.5 (`glm4_moe`, `Family.deepseek_moe`) routes as DeepSeek-V3 does: sigmoid scores, the choice on
score + e_score_correction_bias in n_group groups, the chosen scores renormalised times
routed_scaling_factor (megatron's sigmoid router with moe_router_enable_expert_bias, group-limited
top-k and moe_router_topk_scaling_factor). The bias is megatron's `mlp.router.expert_bias` buffer
(`ParamMap.buffer`: loaded, saved, sent and exported as a parameter is, never trained); the shared
experts are SharedExpertMLP without a gate (HF: `mlp.shared_experts`, plural); q/k norms exist where
config.json's use_qk_norm says (`Family.qk_norm_key`), and a key the file leaves out takes
transformers' default for the family (`Family.config_defaults`).

DeepSeek-V3 (`deepseek_v3`) adds multi-latent attention (`Family.mla`) to GLM-4.5's MoE layout: megatron's
MLASelfAttention under the local spec, the query one projection or a low-rank pair with its norm
(q_lora_rank), keys and values expanded per head from a latent with its norm, interleaved RoPE (or YaRN) on
the rotary channels. Its projections are Layout.COLUMN (split on the output rows) or, for the down
projections, whole on every TP rank (trainer/mcore.py's DuplicatedLinear says why). Its multi-token-prediction
layers (`Family.mtp`; glm4_moe_lite and kimi_k2 share them), built under --mtp-num-layers: HF's layer
num_hidden_layers + k holds enorm, hnorm, eh_proj ([hidden, 2 x hidden], applied to [norm(embedding of the next
token); norm(hidden state)]), shared_head.norm and a whole MoE decoder layer; megatron's MultiTokenPredictionLayer
names them mtp.layers.{k}.enorm / hnorm / eh_proj (Layout.COLUMN) / final_layernorm and mtp_model_layer.<the
decoder layer's names> (`Family.mtp_maps`). The layer's embed_tokens / shared_head.head copies, which DeepSeek-V3's
checkpoint holds and SGLang's draft model never loads (it shares the target's), are not the trainer's: --save-hf copies
them from the HF folder.

MiMo-7B (`mimo`: MiMo-7B-Base, -SFT, -RL) is Qwen2's decoder (q/k/v biases, untied) run by transformers' Qwen2 classes
(`Family.transformers_model_type`), with multi-token-prediction layers under its own names (`Family.mtp_own`,
`Family.mtp_layer_prefix`): model.mtp_layers.{k}.token_layernorm (enorm), hidden_layernorm (hnorm), input_proj and
final_layernorm, and a Qwen2 decoder layer; its input_proj applies to [hidden state; embedding], megatron's eh_proj to
[embedding; hidden state] (Layout.COLUMN_HALVES_SWAPPED), as SGLang's MiMoMTP and slime's mimo converter have it.

GLM-5 / GLM-5.1 / GLM-5.2 (`glm_moe_dsa`, 744B-A40B; GlmMoeDsaForCausalLM) is DeepSeek-V3's layout (GLM's defaults:
one expert group, scaling 2.5, 3 dense layers) with DeepSeek Sparse Attention (`Family.dsa`): in each layer a lightning
indexer (HF `self_attn.indexer.wq_b / wk / k_norm (weight, bias) / weights_proj`, SGLang's Indexer under the same
names: `Family.indexer_params`, whole on every TP rank, never trained) scores every earlier key of the sample for each
query, and the MLA attends only to the index_topk best (trainer/dsa.py). GLM-5.2 shares indexers across layers
(index_topk_freq / index_skip_topk_offset, or index_topk_pattern, or transformers' indexer_types list): a "shared"
layer has no indexer tensors and reuses the last full layer's choice (ModelArch.dsa_indexer_layers). Interleaved RoPE
in the attention and in the indexer: transformers always interleaves both; SGLang reads rope_interleave (absent:
interleaved) and indexer_rope_interleave (absent: the two halves), which the family requires true.

GLM-4 dense (`glm4`: GLM-4-9B-0414, GLM-Z1-9B-0414) is Qwen2's layer with two more norms (`Family.post_norms`): an
RMSNorm on the attention's output and one on the MLP's, each before its residual add (HF's
`post_self_attn_layernorm` / `post_mlp_layernorm`; Megatron: the same names on each TransformerLayer,
trainer/post_norms.py), half of each head rotated in interleaved pairs (`Family.rotary_interleaved`: megatron's
rotary_interleaved), and its MLP's gate and up projections one HF tensor (`gate_up_proj`, [gate; up]:
Layout.FC1_FUSED).

MiniMax-M2 (`minimax_m2`: MiniMax-M2, M2.1, M2.5) is Qwen3-MoE's layout with three differences: its q/k norms
are RMSNorms over all query heads' channels together and over all key heads' (`Family.qk_norm_whole`: weights
[heads x head_dim] and [kv heads x head_dim], trainer/whole_qk_norm.py), the first rotary_dim channels of each
head rotate (rotary_dim / head_dim: megatron's rotary_percent), and its router is sigmoid scores plus
e_score_correction_bias for the choice, the chosen scores renormalised and not scaled (transformers'
MiniMaxM2TopKRouter; SGLang's TopK with renormalize and routed_scaling_factor 1: megatron's sigmoid router with
the expert bias). Its checkpoint names the MoE block `block_sparse_moe` and each expert's projections w1 (gate),
w3 (up), w2 (down); each expert's width is config.json's intermediate_size (`Family.moe_ffn_key`).
Qwen3-Next (`qwen3_next`, Qwen3-Next-80B-A3B) is hybrid (`Family.gated_delta_net`): config.json's layer_types (or
full_attention_interval, default 4: every fourth layer full attention) make most layers Gated DeltaNet linear
attention (megatron-core 0.19's GatedDeltaNet under the trainer's local spec: HF `linear_attn.*`, Megatron
`self_attention.in_proj / conv1d / A_log / dt_bias / out_norm / out_proj`, `Family.linear_attention_params` in place
of `Family.full_attention_params`), the others full attention with a sigmoid output gate (megatron's
attention_output_gate) and q/k norms. HF's q_proj holds each head's query rows then its gate rows; megatron's
linear_qkv holds per query group its queries, their gates, the key and the value (Layout.QKV_GATED). HF's
in_proj_qkvz is grouped per key head ([q, k, v, z] of that head and its value heads) and in_proj_ba likewise ([b, a]
per key head); megatron's in_proj holds, on each TP rank, that rank's heads' [q; k; v; z; b; a] (Layout.GDN_IN_PROJ),
and its conv1d that rank's [q; k; v] channels where HF's holds all q, then all k, then all v (Layout.GDN_CONV). Its
RMSNorms store w and scale by 1 + w (`Family.zero_centered_norms`: megatron's layernorm_zero_centered_gamma), except
the GatedDeltaNet's gated output norm, which scales by w as HF's Qwen3NextRMSNormGated does.

Qwen3.5 (`qwen3_5`: Qwen3.5-9B, 27B) is Qwen3-Next's hybrid text decoder with a dense SwiGLU MLP in every layer, inside
a vision-language checkpoint (Qwen3_5ForConditionalGeneration): config.json nests the decoder's fields in text_config
(`Family.text_config`), the decoder's tensors sit under `model.language_model.` (lm_head at the top), and the
GatedDeltaNet's input projection is four HF tensors: in_proj_qkv ([all q; all k; all v], the conv1d's channel order,
not grouped per key head), in_proj_z, in_proj_b, in_proj_a (Layout.GDN_IN_PROJ_SPLIT). It is a vision-language family
(`vision`) as Qwen2.5-VL is: the trainer runs transformers' vision tower (Qwen3_5VisionModel, Qwen3_5MoeVisionModel for
qwen3_5_moe; from config.json's vision_config) on the first pipeline stage, trained, its merged features at the
prompt's image pads, and its checkpoint names are `model.visual.*` (`vision_prefix`): loaded, saved, exported and sent
under them. The decoder's positions are 3-D (Qwen2.5-VL's rule for still images, transformers' get_rope_index), their
mrope sections interleaved over the rotary frequencies (`mrope_interleaved`: transformers' Qwen3_5TextRotaryEmbedding;
sections 11, 11, 10 of the 32 rotary frequencies of a quarter of each 256-wide head where rope_parameters gives none).
A config.json without vision_config builds the text decoder alone with 1-D RoPE (text positions make both one
rotation), and then the tower is copied through like `mtp.*`, the multi-token-prediction head, which the trainer never
loads, trains or sends (`Family.hf_passthrough`: the engine keeps its copy; --save-hf / tools/convert_megatron_to_hf.py
copy it unchanged from the HF folder the model came from, trainer/hf_export.py). slime's vision-language model
provider (`slime_vl_spec`, slime_plugins.models.qwen3_5_vl) builds the same model (and trains the tower).

Qwen3.5-MoE (`qwen3_5_moe`: Qwen3.5-35B-A3B, Qwen3.6-35B-A3B; Qwen3_5MoeForConditionalGeneration) is Qwen3.5's text
decoder with Qwen3-Next's MoE block in every layer (transformers' Qwen3_5MoeDecoderLayer and SGLang's read neither
mlp_only_layers nor decoder_sparse_step): softmax top-k renormalised (transformers always renormalises; SGLang reads
norm_topk_prob, true when absent: required true) and the sigmoid-gated shared expert; its config.json has no
intermediate_size (no dense MLP), which arch.py takes as one expert's width, as slime's model file does. Its published
checkpoints store a layer's routed experts fused (`Family.fused_experts`): `mlp.experts.gate_up_proj` [experts,
2 x moe_ffn, hidden], each expert's gate rows then its up rows (transformers' forward chunks them so), and
`mlp.experts.down_proj` [experts, hidden, moe_ffn]. The registry keeps one entry per expert under the names
transformers' save_pretrained writes and SGLang's loader takes one expert at a time (`mlp.experts.{e}.gate_proj.weight`
/ `up_proj` / `down_proj`): weight sync sends those, trainer/hf_files.py reads them as slices of the fused tensors
(each EP rank its own experts' rows only) or as they are, and --save-hf writes the fused layout back
(trainer/fused_experts.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

# the named dimensions of `ParamMap.shapes`, defined from config.json in arch.py (`hf_shapes`)
# q = heads x head_dim, kv = kv heads x head_dim; experts = routed experts, moe_ffn = one expert's width,
# shared_ffn = the shared expert's width, one = 1 (the shared expert gate's single output)
DIMS = ("vocab", "hidden", "ffn", "q", "kv", "head", "experts", "moe_ffn", "shared_ffn", "one",
        # multi-latent attention (deepseek_v3): q_lora / kv_lora the latent widths, kv_down = kv_lora + the
        # rotary key width, q_up = heads x (nope + rope) query width, kv_up = heads x (nope key + value)
        # width, o_in = heads x value width
        "q_lora", "kv_lora", "kv_down", "q_up", "kv_up", "o_in",
        # gate_up = 2 x ffn: one HF tensor holding the gate's and the up projection's rows (GLM-4's gate_up_proj)
        "gate_up",
        # Qwen3-Next: q_gate = heads x head_dim x 2 (q_proj's query and gate rows); GatedDeltaNet: gdn_qkvz = 2 x key
        # heads x key head width + 2 x value heads x value head width (in_proj_qkvz), gdn_ba = 2 x value heads,
        # gdn_conv = 2 x key width + value width (the convolved q, k, v channels), gdn_heads = value heads,
        # gdn_vhead = one value head's width, gdn_v = value heads x its width, conv_kernel = the convolution's width
        "q_gate", "gdn_qkvz", "gdn_ba", "gdn_conv", "gdn_heads", "gdn_vhead", "gdn_v", "conv_kernel",
        # a multi-token-prediction layer's eh_proj input: the next token's embedding and the hidden state, concatenated
        "hidden2",
        # DeepSeek Sparse Attention's lightning indexer (glm_moe_dsa): idx_q = index_n_heads x index_head_dim (wq_b's
        # rows), idx_head = index_head_dim (wk's rows, k_norm's width), idx_heads = index_n_heads (weights_proj's rows)
        "idx_q", "idx_head", "idx_heads")


class Layout(Enum):
    REPLICATED = "replicated"  # norms: every TP rank holds the full tensor
    VOCAB = "vocab"  # embedding / output layer: rows padded to the padded vocab, split on dim 0
    QKV = "qkv"  # fused [q; k; v] per query group, split by whole groups on dim 0 (weight or bias)
    FC1 = "fc1"  # fused [gate; up], each half split on dim 0 (SwiGLU)
    # FC1 from one HF tensor already [gate; up] (GLM-4's gate_up_proj): each half split on dim 0, as FC1
    FC1_FUSED = "fc1_fused"
    ROW = "row"  # row-parallel linear (linear_proj, linear_fc2): split on dim 1
    COLUMN = "column"  # column-parallel linear of one output (MLA's projections): split on dim 0
    # Qwen3-Next's gated attention: HF q_proj (per head [query; gate]), k_proj, v_proj -> per query group
    # [queries; gates; key; value], split by whole groups on dim 0 (megatron's attention_output_gate)
    QKV_GATED = "qkv_gated"
    # GatedDeltaNet's in_proj: HF in_proj_qkvz and in_proj_ba (grouped per key head) -> each TP rank's heads'
    # [q; k; v; z; b; a]
    GDN_IN_PROJ = "gdn_in_proj"
    # GatedDeltaNet's conv1d [channels, 1, kernel]: HF's [q; k; v] channels -> each TP rank's [q_r; k_r; v_r]
    GDN_CONV = "gdn_conv"
    # Qwen3.5's GatedDeltaNet in_proj from four HF tensors: in_proj_qkv ([all q; all k; all v], not grouped per key
    # head), in_proj_z, in_proj_b, in_proj_a (each over all value heads in order) -> each TP rank's heads'
    # [q; k; v; z; b; a]
    GDN_IN_PROJ_SPLIT = "gdn_in_proj_split"
    # MiMo's multi-token-prediction input_proj [hidden, 2 x hidden] applies to [hidden state; embedding], megatron's
    # eh_proj to [embedding; hidden state]: the two column halves swapped, then split on dim 0 as COLUMN
    COLUMN_HALVES_SWAPPED = "column_halves_swapped"


@dataclass(frozen=True)
class ParamMap:
    mcore: str  # Megatron name; "{i}" is the layer index
    hf: tuple[str, ...]  # HF names, in the order they are fused (q, k, v) / (gate, up)
    layout: Layout
    # the HF shape of each name in `hf`, in named dimensions (DIMS): what config.json implies
    shapes: tuple[tuple[str, ...], ...] = ()
    untied_only: bool = False  # present only when input and output embeddings are separate
    expert: bool = False  # one routed expert's ("{e}" in both names): split over ETP, spread over EP
    # a persistent buffer of the Megatron module, not a parameter (the router's expert_bias): loaded,
    # saved and sent like a parameter, never trained
    buffer: bool = False

    def at_layer(self, i: int) -> ParamMap:
        return dataclasses.replace(self, mcore=self.mcore.replace("{i}", str(i)),
                                   hf=tuple(h.replace("{i}", str(i)) for h in self.hf))

    def at_expert(self, local: int, global_: int) -> ParamMap:
        """The entry of one expert: Megatron's local index, HF's global one."""
        return dataclasses.replace(self, mcore=self.mcore.replace("{e}", str(local)),
                                   hf=tuple(h.replace("{e}", str(global_)) for h in self.hf))

    def expand_experts(self, num_local: int, first_global: int = 0) -> list[ParamMap]:
        """[self] for a dense entry; for an expert entry, one per local expert j (HF index
        first_global + j)."""
        if not self.expert:
            return [self]
        return [self.at_expert(j, first_global + j) for j in range(num_local)]


@dataclass(frozen=True)
class Family:
    model_type: str
    global_params: tuple[ParamMap, ...]
    layer_params: tuple[ParamMap, ...]
    qkv_bias: bool
    qk_layernorm: bool
    default_tied: bool
    # config.json keys whose value must equal this one (features the Megatron model lacks)
    required_config: dict[str, Any] = field(default_factory=dict)
    # vision-language: the language fields may sit in config.json's text_config, positions are
    # 3-D mRoPE and an HF vision tower feeds the first stage (convert/vision.py)
    vision: bool = False
    # where the checkpoint holds the vision tower's tensors (Qwen2.5-VL's `visual.`, Qwen3.5's `model.visual.`)
    vision_prefix: str = "visual."
    # the mRoPE sections interleave over the rotary frequencies (Qwen3.5: frequency j is the height's when
    # j % 3 == 1 and j < 3 x sections[1], the width's when j % 3 == 2 and j < 3 x sections[2], else the time's;
    # transformers' Qwen3_5TextRotaryEmbedding) rather than following each other (Qwen2.5-VL: megatron's
    # MultimodalRotaryEmbedding); `mrope_default`: the sections where rope_parameters gives none
    mrope_interleaved: bool = False
    mrope_default: tuple[int, ...] = ()
    # mixture of experts: a layer's MLP is megatron's MoELayer (router + routed experts)
    moe: bool = False
    # an MoE family's layers whose MLP is dense (mlp_only_layers / decoder_sparse_step in config.json)
    dense_layer_params: tuple[ParamMap, ...] = ()
    # the MoE block has a shared expert with a sigmoid gate (Qwen2-MoE), megatron's SharedExpertMLP
    shared_expert: bool = False
    # the HF decoder's RMSNorm class when its forward is the stock one (normalize in fp32, round, times
    # the weight): the built-in engine's --enable-torch-compile replaces it by its compiled piece
    # (engines/embedded/compiled.py); None: not checked to be stock, so it runs as it is
    hf_rmsnorm: str | None = None
    # the config.json switch that gives the q/k norms (GLM-4.5's use_qk_norm: the 355B has them, the
    # Air not); None: `qk_layernorm` says for every config of the family
    qk_norm_key: str | None = None
    # the shared expert's output is scaled by a sigmoid gate (Qwen2-MoE); False: added as it is (GLM-4.5)
    shared_expert_gate: bool = True
    # HF's value of a config.json key the file leaves out, where it differs from `required_config`'s
    # (a required key absent from the file is then refused as HF would build it)
    config_defaults: dict[str, Any] = field(default_factory=dict)
    # DeepSeek-V3's MoE block (GLM-4.5 has it too): config.json's n_routed_experts, n_shared_experts x
    # moe_intermediate_size shared, first_k_dense_replace dense layers, and a sigmoid router whose
    # top-k is chosen on score + e_score_correction_bias in n_group groups (topk_group of them), the
    # weights the chosen scores renormalised, times routed_scaling_factor
    deepseek_moe: bool = False
    # multi-latent attention (DeepSeek-V2/V3): megatron-core's MLASelfAttention under the local spec
    mla: bool = False
    # the transformers model_type whose classes run this family where transformers has none of its own
    # (Kimi-K2's config.json says kimi_k2 and names DeepseekV3ForCausalLM); None: model_type itself
    transformers_model_type: str | None = None
    # GLM-4's norms on the attention's and the MLP's outputs before their residual adds (post_self_attn_layernorm,
    # post_mlp_layernorm): trainer/post_norms.py adds them to megatron's TransformerLayer
    post_norms: bool = False
    # the rotary channels rotate in interleaved pairs (x[0::2], x[1::2]; GLM-4), not the two halves (megatron's
    # rotary_interleaved; multi-latent attention interleaves its own way, `mla`)
    rotary_interleaved: bool = False
    # slime's Megatron-LM spec function of this family (--spec MODULE FUNCTION), which builds the same model as
    # the local spec here does (flags_model.py accepts it for this family)
    slime_spec: tuple[str, ...] = ()
    # slime's model provider of the vision-language model (--spec MODULE FUNCTION: Qwen3.5's qwen3_5_vl, the text
    # decoder of slime_spec with the HF vision tower trained on image prompts): the model the trainer builds too
    slime_vl_spec: tuple[str, ...] = ()
    # the q/k norms normalize each token's query over all heads' channels together (and its key over all key
    # heads'), not each head alone (MiniMax-M2's qk_norm_type per_layer): weights [heads x head_dim], [kv heads x
    # head_dim], which trainer/whole_qk_norm.py applies to the gathered heads under tensor parallelism
    qk_norm_whole: bool = False
    # the config.json key of one routed expert's width (MiniMax-M2: intermediate_size; the others
    # moe_intermediate_size)
    moe_ffn_key: str = "moe_intermediate_size"
    # hybrid linear attention (Qwen3-Next): the layers config.json's layer_types name linear_attention hold
    # `linear_attention_params` (megatron's GatedDeltaNet) in place of `full_attention_params`
    gated_delta_net: bool = False
    full_attention_params: tuple[ParamMap, ...] = ()
    linear_attention_params: tuple[ParamMap, ...] = ()
    # the decoder's RMSNorms store w and scale by 1 + w (megatron's layernorm_zero_centered_gamma)
    zero_centered_norms: bool = False
    # the decoder's config.json fields sit in text_config (Qwen3.5's vision-language config.json); with `vision`, a
    # config.json without vision_config builds the text decoder alone (1-D positions)
    text_config: bool = False
    # name prefixes of checkpoint tensors the trainer neither loads nor trains nor sends (Qwen3.5's
    # multi-token-prediction head `mtp.`): the engine keeps its own copy, and --save-hf /
    # tools/convert_megatron_to_hf.py copy them unchanged from the HF folder the model came from
    hf_passthrough: tuple[str, ...] = ()
    # the published checkpoints hold each layer's routed experts as two tensors (Qwen3.5-MoE:
    # `...mlp.experts.gate_up_proj` [experts, 2 x moe_ffn, hidden], each expert's [gate; up] rows, and
    # `...mlp.experts.down_proj` [experts, hidden, moe_ffn]) where the registry names one expert's (`...mlp.experts.{e}.
    # gate_proj.weight` / `up_proj` / `down_proj`, the names weight sync sends): trainer/hf_files.py reads either form,
    # --save-hf / tools/convert_megatron_to_hf.py write the fused one (trainer/fused_experts.py)
    fused_experts: bool = False
    # DeepSeek Sparse Attention (GLM-5's glm_moe_dsa): multi-latent attention whose every query attends only to the
    # index_topk keys a lightning indexer scores highest; the indexer's tensors (`indexer_params`) sit in the layers
    # that run their own indexer (transformers' indexer_types "full"), the others ("shared") reuse the top-k of the
    # last full layer before them (trainer/dsa.py)
    dsa: bool = False
    indexer_params: tuple[ParamMap, ...] = ()
    # DeepSeek-V3's multi-token-prediction layers (num_nextn_predict_layers), which the trainer builds under
    # --mtp-num-layers: HF's layer num_hidden_layers + k holds enorm, hnorm, eh_proj, shared_head.norm and a whole
    # decoder layer (`mtp_maps`); False: --mtp-num-layers is refused for the family
    mtp: bool = False
    # an MTP layer's own four entries ("{k}": the MTP layer, "{i}": HF's layer index num_hidden_layers + k) and the
    # HF prefix of its decoder layer's tensors; () / "": DeepSeek-V3's (`_MTP_OWN`, model.layers.{i}.)
    mtp_own: tuple[ParamMap, ...] = ()
    mtp_layer_prefix: str = ""

    def mtp_maps(self, num_layers: int, k: int, layer: tuple[ParamMap, ...]) -> list[ParamMap]:
        """The entries of multi-token-prediction layer k (megatron's `mtp.layers.{k}.`, HF's layer num_layers + k):
        its own four tensors, then `layer` (the decoder layer entries it holds: an MoE family's MoE layer) under
        `mtp.layers.{k}.mtp_model_layer.`; expert entries keep their "{e}" (`ParamMap.expand_experts`)."""
        if not self.mtp:
            raise ValueError(f"model_type {self.model_type!r}: no multi-token-prediction layers in this family")
        i = num_layers + k
        own = [dataclasses.replace(p, mcore=p.mcore.replace("{k}", str(k)),
                                   hf=tuple(h.replace("{i}", str(i)).replace("{k}", str(k)) for h in p.hf))
               for p in self.mtp_own or _MTP_OWN]
        prefix = self.mtp_layer_prefix.replace("{k}", str(k)) if self.mtp_layer_prefix else f"model.layers.{i}."
        return own + [dataclasses.replace(p, mcore=f"mtp.layers.{k}.mtp_model_layer." + p.mcore[len(_L):],
                                          hf=tuple(prefix + h[len(_H):] for h in p.hf)) for p in layer]

    def builds_vision(self, cfg: dict[str, Any]) -> bool:
        """Whether the trainer builds a vision tower for this config.json: every vision-language family's, except
        where Qwen3.5's (text_config) has no vision_config: its text decoder alone then."""
        return self.vision and not (self.text_config and "vision_config" not in cfg)

    def config_value(self, cfg: dict[str, Any], key: str, default: Any = None) -> Any:
        """config.json's value of `key`, or transformers' default for this family when the file leaves it
        out (config_defaults), or `default`."""
        return cfg[key] if cfg.get(key) is not None else self.config_defaults.get(key, default)

    def mla_dims(self, cfg: dict[str, Any]) -> dict[str, int]:
        """Multi-latent attention's widths as config.json gives them (transformers' defaults for a key the file
        leaves out; q_lora_rank null, or 0 here: one query projection), unchecked."""
        q_lora = cfg["q_lora_rank"] if "q_lora_rank" in cfg else self.config_defaults.get("q_lora_rank")
        return {"q_lora_rank": int(q_lora or 0),
                **{k: int(self.config_value(cfg, k, 0)) for k in ("kv_lora_rank", "qk_nope_head_dim",
                                                                  "qk_rope_head_dim", "v_head_dim")}}

    def layer_maps(self, moe_layer: bool = True, qk_norm: bool | None = None,
                   q_lora: bool | None = None, linear: bool = False, indexer: bool = False) -> tuple[ParamMap, ...]:
        """The entries of one layer: an MoE family's dense layers (moe_layer=False) have a dense MLP;
        qk_norm=False drops the q/k norms of a family whose config switches them (qk_norm_key); for
        multi-latent attention q_lora says whether the query goes through its low-rank pair (q_lora_rank)
        or one projection (q_lora_rank null); linear=True: a hybrid family's linear-attention layer (its
        GatedDeltaNet's entries where the full attention's are, right after the input norm); indexer=True: a DSA
        layer that runs its own lightning indexer (its entries right after the attention's output projection, where
        HF's module order puts self_attn.indexer)."""
        if self.moe and not moe_layer:
            if not self.dense_layer_params:
                raise ValueError(f"model_type {self.model_type!r}: no dense layers in this family")
            maps = self.dense_layer_params
        else:
            maps = self.layer_params
        if qk_norm is False and self.qk_norm_key is not None:
            maps = tuple(p for p in maps if p not in _QK_NORM)
        if self.mla:
            drop = _MLA_Q_ONE if q_lora is not False else _MLA_Q_LORA
            maps = tuple(p for p in maps if p not in drop)
        if linear:
            if not self.gated_delta_net:
                raise ValueError(f"model_type {self.model_type!r}: no linear-attention layers in this family")
            rest = tuple(p for p in maps if p not in self.full_attention_params)
            maps = (rest[0], *self.linear_attention_params, *rest[1:])
        if indexer:
            if not self.dsa:
                raise ValueError(f"model_type {self.model_type!r}: no sparse-attention indexer in this family")
            at = 1 + next(k for k, p in enumerate(maps) if p.mcore.endswith("self_attention.linear_proj.weight"))
            maps = (*maps[:at], *self.indexer_params, *maps[at:])
        return maps

    def param_maps(self, num_layers: int, tied: bool, num_experts: int = 0,
                   moe_layers: tuple[bool, ...] = (), qk_norm: bool | None = None,
                   q_lora: bool | None = None, linear_layers: tuple[bool, ...] = (),
                   indexer_layers: tuple[bool, ...] = ()) -> list[ParamMap]:
        """Every parameter of the model, embedding first, in layer order, output layer last (an
        MoE family's experts in expert order, as if one rank held them all). `moe_layers`: per
        layer whether its MLP is an MoE block (empty: every layer's is, for an MoE family);
        `qk_norm`: the config's q/k norm switch (qk_norm_key); `q_lora`: MLA's query low-rank pair;
        `linear_layers`: per layer whether it is linear attention (empty: none is); `indexer_layers`: per layer
        whether it runs its own sparse-attention indexer (empty: none does)."""
        first = [p for p in self.global_params if p.mcore.startswith("embedding.")]
        last = [p for p in self.global_params if not p.mcore.startswith("embedding.")]
        maps = list(first)
        for i in range(num_layers):
            layer = self.layer_maps(moe_layers[i] if moe_layers else True, qk_norm, q_lora,
                                    bool(linear_layers) and linear_layers[i],
                                    bool(indexer_layers) and indexer_layers[i])
            maps += [e for p in layer for e in p.at_layer(i).expand_experts(num_experts)]
        maps += last
        return [p for p in maps if not (p.untied_only and tied)]


_L = "decoder.layers.{i}."
_H = "model.layers.{i}."
_VEC = (("hidden",),)

_GLOBAL = (
    ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Layout.VOCAB,
             (("vocab", "hidden"),)),
    ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), Layout.REPLICATED, _VEC),
    ParamMap("output_layer.weight", ("lm_head.weight",), Layout.VOCAB, (("vocab", "hidden"),), untied_only=True),
)

_NORMS = (
    ParamMap(_L + "input_layernorm.weight", (_H + "input_layernorm.weight",), Layout.REPLICATED, _VEC),
    ParamMap(_L + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",),
             Layout.REPLICATED, _VEC),
)
_QKV_W = ParamMap(_L + "self_attention.linear_qkv.weight",
                  tuple(_H + f"self_attn.{x}_proj.weight" for x in "qkv"), Layout.QKV,
                  (("q", "hidden"), ("kv", "hidden"), ("kv", "hidden")))
_QKV_B = ParamMap(_L + "self_attention.linear_qkv.bias",
                  tuple(_H + f"self_attn.{x}_proj.bias" for x in "qkv"), Layout.QKV, (("q",), ("kv",), ("kv",)))
_PROJ = ParamMap(_L + "self_attention.linear_proj.weight", (_H + "self_attn.o_proj.weight",), Layout.ROW,
                 (("hidden", "q"),))
_MLP = (
    ParamMap(_L + "mlp.linear_fc1.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
             Layout.FC1, (("ffn", "hidden"), ("ffn", "hidden"))),
    ParamMap(_L + "mlp.linear_fc2.weight", (_H + "mlp.down_proj.weight",), Layout.ROW, (("hidden", "ffn"),)),
)
_QK_NORM = (
    ParamMap(_L + "self_attention.q_layernorm.weight", (_H + "self_attn.q_norm.weight",),
             Layout.REPLICATED, (("head",),)),
    ParamMap(_L + "self_attention.k_layernorm.weight", (_H + "self_attn.k_norm.weight",),
             Layout.REPLICATED, (("head",),)),
)
_SWIGLU = {"hidden_act": "silu"}
_E = _H + "mlp.experts.{e}."
_MOE = (
    ParamMap(_L + "mlp.router.weight", (_H + "mlp.gate.weight",), Layout.REPLICATED, (("experts", "hidden"),)),
    ParamMap(_L + "mlp.experts.local_experts.{e}.linear_fc1.weight", (_E + "gate_proj.weight", _E + "up_proj.weight"),
             Layout.FC1, (("moe_ffn", "hidden"), ("moe_ffn", "hidden")), expert=True),
    ParamMap(_L + "mlp.experts.local_experts.{e}.linear_fc2.weight", (_E + "down_proj.weight",), Layout.ROW,
             (("hidden", "moe_ffn"),), expert=True),
)

_S = _H + "mlp.shared_expert."
_SHARED_EXPERT = (
    ParamMap(_L + "mlp.shared_experts.linear_fc1.weight", (_S + "gate_proj.weight", _S + "up_proj.weight"),
             Layout.FC1, (("shared_ffn", "hidden"), ("shared_ffn", "hidden"))),
    ParamMap(_L + "mlp.shared_experts.linear_fc2.weight", (_S + "down_proj.weight",), Layout.ROW,
             (("hidden", "shared_ffn"),)),
    ParamMap(_L + "mlp.shared_experts.gate_weight", (_H + "mlp.shared_expert_gate.weight",), Layout.REPLICATED,
             (("one", "hidden"),)),
)

# GLM-4 dense: the norms after attention and after the MLP, the MLP's gate and up in one HF tensor
_POST_NORMS = (
    ParamMap(_L + "post_self_attn_layernorm.weight", (_H + "post_self_attn_layernorm.weight",), Layout.REPLICATED,
             _VEC),
    ParamMap(_L + "post_mlp_layernorm.weight", (_H + "post_mlp_layernorm.weight",), Layout.REPLICATED, _VEC),
)
_MLP_GATE_UP = ParamMap(_L + "mlp.linear_fc1.weight", (_H + "mlp.gate_up_proj.weight",), Layout.FC1_FUSED,
                        (("gate_up", "hidden"),))

# GLM-4.5's shared experts: megatron's SharedExpertMLP without a gate (HF: mlp.shared_experts, plural)
_G = _H + "mlp.shared_experts."
_SHARED_EXPERTS_UNGATED = (
    ParamMap(_L + "mlp.shared_experts.linear_fc1.weight", (_G + "gate_proj.weight", _G + "up_proj.weight"),
             Layout.FC1, (("shared_ffn", "hidden"), ("shared_ffn", "hidden"))),
    ParamMap(_L + "mlp.shared_experts.linear_fc2.weight", (_G + "down_proj.weight",), Layout.ROW,
             (("hidden", "shared_ffn"),)),
)
# a sigmoid router's selection bias (aux-loss-free balancing): megatron's TopKRouter.expert_bias buffer,
# HF's e_score_correction_bias; fp32 in both
_EXPERT_BIAS = ParamMap(_L + "mlp.router.expert_bias", (_H + "mlp.gate.e_score_correction_bias",),
                        Layout.REPLICATED, (("experts",),), buffer=True)

# MiniMax-M2: the q/k norms over all heads' channels (Family.qk_norm_whole), whole on every TP rank; the MoE block
# under the checkpoint's names (block_sparse_moe; w1 gate, w3 up, w2 down), its router's selection bias a buffer
_QK_NORM_WHOLE = (
    ParamMap(_L + "self_attention.q_norm.weight", (_H + "self_attn.q_norm.weight",), Layout.REPLICATED, (("q",),)),
    ParamMap(_L + "self_attention.k_norm.weight", (_H + "self_attn.k_norm.weight",), Layout.REPLICATED, (("kv",),)),
)
_B = _H + "block_sparse_moe."
_BLOCK_SPARSE_MOE = (
    ParamMap(_L + "mlp.router.weight", (_B + "gate.weight",), Layout.REPLICATED, (("experts", "hidden"),)),
    ParamMap(_L + "mlp.router.expert_bias", (_B + "e_score_correction_bias",), Layout.REPLICATED, (("experts",),),
             buffer=True),
    ParamMap(_L + "mlp.experts.local_experts.{e}.linear_fc1.weight", (_B + "experts.{e}.w1.weight",
                                                                      _B + "experts.{e}.w3.weight"),
             Layout.FC1, (("moe_ffn", "hidden"), ("moe_ffn", "hidden")), expert=True),
    ParamMap(_L + "mlp.experts.local_experts.{e}.linear_fc2.weight", (_B + "experts.{e}.w2.weight",), Layout.ROW,
             (("hidden", "moe_ffn"),), expert=True),
)

# multi-latent attention (DeepSeek-V3): megatron's MLASelfAttention (local spec) against HF's DeepseekV3Attention.
# The up projections (and one q_proj) are column-parallel linears split on their output rows, the down
# projections whole on every TP rank (trainer/mcore.py's DuplicatedLinear says why); the latent norms are
# megatron's q_layernorm / kv_layernorm. The query is one projection (q_proj) when q_lora_rank is null, else the
# low-rank pair with its norm.
_A = _L + "self_attention."
_MLA_Q_ONE = (ParamMap(_A + "linear_q_proj.weight", (_H + "self_attn.q_proj.weight",), Layout.COLUMN,
                       (("q_up", "hidden"),)),)
_MLA_Q_LORA = (
    ParamMap(_A + "linear_q_down_proj.weight", (_H + "self_attn.q_a_proj.weight",), Layout.REPLICATED,
             (("q_lora", "hidden"),)),
    ParamMap(_A + "q_layernorm.weight", (_H + "self_attn.q_a_layernorm.weight",), Layout.REPLICATED, (("q_lora",),)),
    ParamMap(_A + "linear_q_up_proj.weight", (_H + "self_attn.q_b_proj.weight",), Layout.COLUMN,
             (("q_up", "q_lora"),)),
)
# q_a_proj right before kv_a_proj_with_mqa: weight sync keeps the pair in one bucket, as SGLang's DeepSeek
# loader needs them in one call (weight_sync/broadcast.py)
_MLA = (
    *_MLA_Q_ONE, _MLA_Q_LORA[0],
    ParamMap(_A + "linear_kv_down_proj.weight", (_H + "self_attn.kv_a_proj_with_mqa.weight",), Layout.REPLICATED,
             (("kv_down", "hidden"),)),
    *_MLA_Q_LORA[1:],
    ParamMap(_A + "kv_layernorm.weight", (_H + "self_attn.kv_a_layernorm.weight",), Layout.REPLICATED,
             (("kv_lora",),)),
    ParamMap(_A + "linear_kv_up_proj.weight", (_H + "self_attn.kv_b_proj.weight",), Layout.COLUMN,
             (("kv_up", "kv_lora"),)),
    ParamMap(_A + "linear_proj.weight", (_H + "self_attn.o_proj.weight",), Layout.ROW, (("hidden", "o_in"),)),
)

# DeepSeek Sparse Attention's lightning indexer (GLM-5: HF's self_attn.indexer, SGLang's Indexer under the same names):
# the query projection from the query latent (wq_b), one key from the hidden state (wk) and its LayerNorm (weight and
# bias), the per-head weights (weights_proj). Whole on every TP rank (each rank chooses the same keys for its heads),
# and never trained (trainer/dsa.py says why)
_I = _H + "self_attn.indexer."
_IDX = _A + "core_attention.indexer."
_INDEXER = (
    ParamMap(_IDX + "wq_b.weight", (_I + "wq_b.weight",), Layout.REPLICATED, (("idx_q", "q_lora"),)),
    ParamMap(_IDX + "wk.weight", (_I + "wk.weight",), Layout.REPLICATED, (("idx_head", "hidden"),)),
    ParamMap(_IDX + "k_norm.weight", (_I + "k_norm.weight",), Layout.REPLICATED, (("idx_head",),)),
    ParamMap(_IDX + "k_norm.bias", (_I + "k_norm.bias",), Layout.REPLICATED, (("idx_head",),)),
    ParamMap(_IDX + "weights_proj.weight", (_I + "weights_proj.weight",), Layout.REPLICATED,
             (("idx_heads", "hidden"),)),
)

# Qwen3-Next: full attention with a sigmoid output gate (q_proj's rows per head: query, then gate), and
# megatron's GatedDeltaNet in the linear-attention layers
_QKV_GATED = ParamMap(_L + "self_attention.linear_qkv.weight",
                      tuple(_H + f"self_attn.{x}_proj.weight" for x in "qkv"), Layout.QKV_GATED,
                      (("q_gate", "hidden"), ("kv", "hidden"), ("kv", "hidden")))
_GATED_ATTENTION = (_QKV_GATED, *_QK_NORM, _PROJ)
_N = _H + "linear_attn."
_GDN = (
    ParamMap(_A + "in_proj.weight", (_N + "in_proj_qkvz.weight", _N + "in_proj_ba.weight"), Layout.GDN_IN_PROJ,
             (("gdn_qkvz", "hidden"), ("gdn_ba", "hidden"))),
    ParamMap(_A + "conv1d.weight", (_N + "conv1d.weight",), Layout.GDN_CONV, (("gdn_conv", "one", "conv_kernel"),)),
    ParamMap(_A + "dt_bias", (_N + "dt_bias",), Layout.COLUMN, (("gdn_heads",),)),
    ParamMap(_A + "A_log", (_N + "A_log",), Layout.COLUMN, (("gdn_heads",),)),
    ParamMap(_A + "out_norm.weight", (_N + "norm.weight",), Layout.REPLICATED, (("gdn_vhead",),)),
    ParamMap(_A + "out_proj.weight", (_N + "out_proj.weight",), Layout.ROW, (("hidden", "gdn_v"),)),
)


# DeepSeek-V3's multi-token-prediction layer k (megatron-core's MultiTokenPredictionLayer under the local spec): the
# norms of the next token's embedding (enorm) and of the decoder's last hidden state (hnorm), the projection of the two
# concatenated ([embedding; hidden], 2 x hidden wide) back to hidden, a column-parallel linear (eh_proj), and the norm
# before the shared output layer (megatron's final_layernorm, HF's shared_head.norm); HF's layer num_layers + k
_MTP_OWN = (
    ParamMap("mtp.layers.{k}.enorm.weight", (_H + "enorm.weight",), Layout.REPLICATED, _VEC),
    ParamMap("mtp.layers.{k}.hnorm.weight", (_H + "hnorm.weight",), Layout.REPLICATED, _VEC),
    ParamMap("mtp.layers.{k}.eh_proj.weight", (_H + "eh_proj.weight",), Layout.COLUMN, (("hidden", "hidden2"),)),
    ParamMap("mtp.layers.{k}.final_layernorm.weight", (_H + "shared_head.norm.weight",), Layout.REPLICATED, _VEC),
)


def _language_model(maps: tuple[ParamMap, ...]) -> tuple[ParamMap, ...]:
    """The same entries under a vision-language checkpoint's decoder names (model.X -> model.language_model.X;
    lm_head stays at the top, as Qwen3_5ForConditionalGeneration saves it)."""
    def rename(h: str) -> str:
        return "model.language_model." + h[len("model."):] if h.startswith("model.") else h
    return tuple(dataclasses.replace(p, hf=tuple(rename(h) for h in p.hf)) for p in maps)


# Qwen3.5's GatedDeltaNet: Qwen3-Next's, its input projection four HF tensors (Layout.GDN_IN_PROJ_SPLIT)
_GDN_SPLIT = (
    ParamMap(_A + "in_proj.weight", tuple(_N + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")),
             Layout.GDN_IN_PROJ_SPLIT, (("gdn_conv", "hidden"), ("gdn_v", "hidden"), ("gdn_heads", "hidden"),
                                        ("gdn_heads", "hidden"))),
    *_GDN[1:],
)

# Qwen3.5's vision tower (transformers' Qwen3_5VisionModel / Qwen3_5MoeVisionModel under model.visual.) and its
# interleaved 3-D rotary positions (transformers' default sections 11, 11, 10 of the 32 rotary frequencies); slime's
# vision-language provider besides the text spec (slime_plugins.models.qwen3_5_vl)
_QWEN3_5_VISION: dict[str, Any] = {
    "vision": True, "vision_prefix": "model.visual.", "mrope_interleaved": True, "mrope_default": (11, 11, 10),
    "slime_vl_spec": ("slime_plugins.models.qwen3_5_vl", "get_qwen3_5_vl_model_provider")}

FAMILIES: dict[str, Family] = {
    "qwen2": Family(
        model_type="qwen2", global_params=_GLOBAL, hf_rmsnorm="Qwen2RMSNorm",
        layer_params=(_NORMS[0], _QKV_W, _QKV_B, _PROJ, _NORMS[1], *_MLP),
        qkv_bias=True, qk_layernorm=False, default_tied=False,
        required_config={**_SWIGLU, "use_sliding_window": False},
    ),
    # hf_rmsnorm None: Qwen2_5_VLRMSNorm is its own class, not checked against the stock forward
    "qwen2_5_vl": Family(
        model_type="qwen2_5_vl", global_params=_GLOBAL,
        layer_params=(_NORMS[0], _QKV_W, _QKV_B, _PROJ, _NORMS[1], *_MLP),
        qkv_bias=True, qk_layernorm=False, default_tied=False,
        required_config={**_SWIGLU, "use_sliding_window": False}, vision=True,
    ),
    "llama": Family(
        model_type="llama", global_params=_GLOBAL, hf_rmsnorm="LlamaRMSNorm",
        layer_params=(_NORMS[0], _QKV_W, _PROJ, _NORMS[1], *_MLP),
        qkv_bias=False, qk_layernorm=False, default_tied=False,
        # attention_bias adds an o_proj bias too, which needs add_bias_linear for every linear
        required_config={**_SWIGLU, "attention_bias": False, "mlp_bias": False},
    ),
    "qwen3": Family(
        model_type="qwen3", global_params=_GLOBAL, hf_rmsnorm="Qwen3RMSNorm",
        layer_params=(_NORMS[0], _QKV_W, *_QK_NORM, _PROJ, _NORMS[1], *_MLP),
        qkv_bias=False, qk_layernorm=True, default_tied=False,
        required_config={**_SWIGLU, "attention_bias": False, "use_sliding_window": False},
    ),
    # Qwen3-30B-A3B / 235B-A22B: every layer sparse (no shared expert), q/k-norm as qwen3
    "qwen3_moe": Family(
        model_type="qwen3_moe", global_params=_GLOBAL, hf_rmsnorm="Qwen3MoeRMSNorm",
        layer_params=(_NORMS[0], _QKV_W, *_QK_NORM, _PROJ, _NORMS[1], *_MOE),
        qkv_bias=False, qk_layernorm=True, default_tied=False,
        # a dense MLP in some layers (mlp_only_layers, decoder_sparse_step > 1): megatron's
        # per-layer MoE pattern (moe_layer_freq as a list)
        required_config={**_SWIGLU, "attention_bias": False, "use_sliding_window": False},
        moe=True,
        dense_layer_params=(_NORMS[0], _QKV_W, *_QK_NORM, _PROJ, _NORMS[1], *_MLP),
    ),
    # Qwen1.5-MoE-A2.7B / Qwen2-57B-A14B: q/k/v biases as qwen2, routed experts plus one shared
    # expert whose output is scaled by sigmoid(shared_expert_gate(x)); dense layers as qwen2's
    "qwen2_moe": Family(
        model_type="qwen2_moe", global_params=_GLOBAL, hf_rmsnorm="Qwen2MoeRMSNorm",
        layer_params=(_NORMS[0], _QKV_W, _QKV_B, _PROJ, _NORMS[1], *_MOE, *_SHARED_EXPERT),
        qkv_bias=True, qk_layernorm=False, default_tied=False,
        required_config={**_SWIGLU, "use_sliding_window": False, "qkv_bias": True},
        moe=True,
        dense_layer_params=(_NORMS[0], _QKV_W, _QKV_B, _PROJ, _NORMS[1], *_MLP),
        shared_expert=True,
    ),
    # GLM-4.5 / 4.6 / 4.7 (355B-A32B) and GLM-4.5-Air (106B-A12B): q/k/v biases, q/k norms where
    # use_qk_norm, half of each head rotated (partial_rotary_factor), the first first_k_dense_replace
    # layers dense, then routed experts chosen by sigmoid scores plus e_score_correction_bias (in
    # n_group groups), weighted by the renormalised sigmoid scores times routed_scaling_factor, plus
    # n_shared_experts ungated shared experts
    "glm4_moe": Family(
        model_type="glm4_moe", global_params=_GLOBAL, hf_rmsnorm="Glm4MoeRMSNorm",
        layer_params=(_NORMS[0], _QKV_W, _QKV_B, *_QK_NORM, _PROJ, _NORMS[1], *_MOE[:1], _EXPERT_BIAS, *_MOE[1:],
                      *_SHARED_EXPERTS_UNGATED),
        qkv_bias=True, qk_layernorm=True, default_tied=False, qk_norm_key="use_qk_norm",
        required_config={**_SWIGLU, "attention_bias": True, "norm_topk_prob": True},
        # transformers' Glm4MoeConfig defaults, for a config.json that leaves a key out
        config_defaults={"attention_bias": False, "first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 1,
                         "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True, "use_qk_norm": False,
                         "partial_rotary_factor": 0.5},
        moe=True,
        dense_layer_params=(_NORMS[0], _QKV_W, _QKV_B, *_QK_NORM, _PROJ, _NORMS[1], *_MLP),
        shared_expert=True, shared_expert_gate=False, deepseek_moe=True,
    ),
    # GLM-4-9B-0414 / GLM-Z1-9B-0414 / GLM-Z1-Rumination: qwen2's layer (q/k/v biases, GQA) with a norm after
    # attention and after the MLP (each before its residual add), half of each head rotated in interleaved pairs,
    # the MLP's gate and up as one tensor
    "glm4": Family(
        model_type="glm4", global_params=_GLOBAL, hf_rmsnorm="Glm4RMSNorm",
        layer_params=(_NORMS[0], _QKV_W, _QKV_B, _PROJ, _POST_NORMS[0], _NORMS[1], _MLP_GATE_UP, _MLP[1],
                      _POST_NORMS[1]),
        qkv_bias=True, qk_layernorm=False, default_tied=False,
        required_config={**_SWIGLU, "attention_bias": True},
        # transformers' Glm4Config defaults, for a config.json that leaves a key out
        config_defaults={"attention_bias": True, "partial_rotary_factor": 0.5, "head_dim": 128,
                         "num_key_value_heads": 2, "rms_norm_eps": 1.5625e-07, "max_position_embeddings": 131072},
        post_norms=True, rotary_interleaved=True, slime_spec=("slime_plugins.models.glm4", "get_glm_spec"),
    ),
    # DeepSeek-V3 / R1, Moonlight (q_lora_rank null), Kimi-K2's architecture: multi-latent attention (no q/k/v
    # bias), the first first_k_dense_replace layers dense, then GLM-4.5's routing (sigmoid + expert bias, groups,
    # routed_scaling_factor) and n_shared_experts ungated shared experts
    "deepseek_v3": Family(
        model_type="deepseek_v3", global_params=_GLOBAL, hf_rmsnorm="DeepseekV3RMSNorm",
        layer_params=(_NORMS[0], *_MLA, _NORMS[1], *_MOE[:1], _EXPERT_BIAS, *_MOE[1:], *_SHARED_EXPERTS_UNGATED),
        qkv_bias=False, qk_layernorm=True, default_tied=False,
        required_config={**_SWIGLU, "attention_bias": False, "norm_topk_prob": True, "rope_interleave": True},
        # transformers' DeepseekV3Config defaults, for a config.json that leaves a key out
        config_defaults={"first_k_dense_replace": 3, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
                         "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rope_interleave": True,
                         "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                         "v_head_dim": 128, "attention_bias": False},
        moe=True,
        dense_layer_params=(_NORMS[0], *_MLA, _NORMS[1], *_MLP),
        shared_expert=True, shared_expert_gate=False, deepseek_moe=True, mla=True, mtp=True,
    ),
    # MiniMax-M2 / M2.1 / M2.5 (230B-A10B): GQA without biases, q/k norms over all heads' channels, the first
    # rotary_dim channels of each head rotated, every layer 256 routed experts (no shared expert) chosen by sigmoid
    # scores plus e_score_correction_bias, weighted by the renormalised scores. SGLang reads use_qk_norm,
    # qk_norm_type, scoring_func and use_routing_bias from config.json (absent: no q/k norm, no bias), transformers
    # builds all of them whatever the file says: the file must say what both run
    "minimax_m2": Family(
        model_type="minimax_m2", global_params=_GLOBAL, hf_rmsnorm="MiniMaxM2RMSNorm",
        layer_params=(_NORMS[0], _QKV_W, *_QK_NORM_WHOLE, _PROJ, _NORMS[1], *_BLOCK_SPARSE_MOE),
        qkv_bias=False, qk_layernorm=True, default_tied=False,
        required_config={**_SWIGLU, "use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
                         "use_routing_bias": True},
        # transformers' MiniMaxM2Config defaults and SGLang's reading of an absent key (use_qk_norm,
        # use_routing_bias: off; scoring_func: none, SGLang fails without it)
        config_defaults={"use_qk_norm": False, "qk_norm_type": "per_layer", "scoring_func": None,
                         "use_routing_bias": False, "head_dim": 128, "num_key_value_heads": 8, "rms_norm_eps": 1e-6,
                         "max_position_embeddings": 196608, "num_local_experts": 256, "num_experts_per_tok": 8},
        moe=True, qk_norm_whole=True, moe_ffn_key="intermediate_size",
        slime_spec=("slime_plugins.models.minimax_m2", "get_minimax_m2_layer_spec"),
    ),
    # Qwen3-Next-80B-A3B (Instruct, Thinking): hybrid layers (Gated DeltaNet linear attention, every
    # full_attention_interval-th layer full attention with an output gate, q/k norms, a quarter of each head rotated),
    # zero-centred RMSNorms, every layer's MLP a softmax top-k MoE block (renormalised) with a sigmoid-gated shared
    # expert; dense layers (mlp_only_layers) as qwen2_moe's
    "qwen3_next": Family(
        model_type="qwen3_next", global_params=_GLOBAL,
        layer_params=(_NORMS[0], *_GATED_ATTENTION, _NORMS[1], *_MOE, *_SHARED_EXPERT),
        qkv_bias=False, qk_layernorm=True, default_tied=False,
        required_config={**_SWIGLU, "attention_bias": False, "norm_topk_prob": True},
        # transformers' Qwen3NextConfig defaults, for a config.json that leaves a key out
        config_defaults={"attention_bias": False, "partial_rotary_factor": 0.25, "head_dim": 256,
                         "num_key_value_heads": 2, "norm_topk_prob": True, "full_attention_interval": 4,
                         "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                         "linear_num_key_heads": 16, "linear_num_value_heads": 32, "rms_norm_eps": 1e-6},
        moe=True,
        dense_layer_params=(_NORMS[0], *_GATED_ATTENTION, _NORMS[1], *_MLP),
        shared_expert=True,
        gated_delta_net=True, full_attention_params=_GATED_ATTENTION, linear_attention_params=_GDN,
        zero_centered_norms=True,
        slime_spec=("slime_plugins.models.qwen3_next", "get_qwen3_next_spec"),
    ),
    # Qwen3.5-9B / 27B (Qwen3_5ForConditionalGeneration): the text decoder is Qwen3-Next's hybrid (Gated DeltaNet
    # layers, every full_attention_interval-th layer gated full attention with q/k norms, a quarter of each head
    # rotated, zero-centred norms) with a dense SwiGLU MLP in every layer and the GatedDeltaNet's in_proj as four
    # tensors; its fields in config.json's text_config, its tensors under model.language_model.
    "qwen3_5": Family(
        model_type="qwen3_5", global_params=_language_model(_GLOBAL),
        layer_params=_language_model((_NORMS[0], *_GATED_ATTENTION, _NORMS[1], *_MLP)),
        qkv_bias=False, qk_layernorm=True, default_tied=False,
        # attn_output_gate: SGLang gates the full attention only where it is true or absent; transformers always does
        required_config={**_SWIGLU, "attention_bias": False, "attn_output_gate": True},
        # transformers' Qwen3_5TextConfig defaults, for a config.json that leaves a key out
        config_defaults={"attention_bias": False, "partial_rotary_factor": 0.25, "head_dim": 256,
                         "num_key_value_heads": 4, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
                         "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                         "linear_num_value_heads": 32, "rms_norm_eps": 1e-6},
        gated_delta_net=True, full_attention_params=_language_model(_GATED_ATTENTION),
        linear_attention_params=_language_model(_GDN_SPLIT), zero_centered_norms=True,
        text_config=True, hf_passthrough=("mtp.",), **_QWEN3_5_VISION,
        slime_spec=("slime_plugins.models.qwen3_5", "get_qwen3_5_spec"),
    ),
    # Qwen3.5-35B-A3B / Qwen3.6-35B-A3B (Qwen3_5MoeForConditionalGeneration): qwen3_5's hybrid text decoder with
    # qwen3_next's MoE block in every layer (softmax top-k renormalised, a sigmoid-gated shared expert), the routed
    # experts stored fused in the checkpoint (fused_experts)
    "qwen3_5_moe": Family(
        model_type="qwen3_5_moe", global_params=_language_model(_GLOBAL),
        layer_params=_language_model((_NORMS[0], *_GATED_ATTENTION, _NORMS[1], *_MOE, *_SHARED_EXPERT)),
        qkv_bias=False, qk_layernorm=True, default_tied=False,
        # norm_topk_prob: transformers' router always renormalises, SGLang's reads the key (absent: true);
        # attn_output_gate as qwen3_5's
        required_config={**_SWIGLU, "attention_bias": False, "attn_output_gate": True, "norm_topk_prob": True},
        # transformers' Qwen3_5MoeTextConfig defaults, for a config.json that leaves a key out (norm_topk_prob:
        # SGLang's, from Qwen3NextConfig)
        config_defaults={"attention_bias": False, "partial_rotary_factor": 0.25, "head_dim": 256,
                         "num_key_value_heads": 2, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
                         "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                         "linear_num_value_heads": 32, "rms_norm_eps": 1e-6, "norm_topk_prob": True,
                         "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                         "shared_expert_intermediate_size": 512},
        moe=True, shared_expert=True,
        gated_delta_net=True, full_attention_params=_language_model(_GATED_ATTENTION),
        linear_attention_params=_language_model(_GDN_SPLIT), zero_centered_norms=True,
        text_config=True, hf_passthrough=("mtp.",), fused_experts=True, **_QWEN3_5_VISION,
        slime_spec=("slime_plugins.models.qwen3_5", "get_qwen3_5_spec"),
    ),
}


# GLM-4.7-Flash (30B-A3B): GLM-4.5's MoE under DeepSeek-V3's multi-latent attention (transformers'
# Glm4MoeLite: DeepseekV3Attention in Glm4Moe's layers; SGLang's glm4_moe_lite: DeepseekV2AttentionMLA). Its
# dense layers: transformers reads mlp_layer_types (default: the first), SGLang first_k_dense_replace
# (arch.py takes the file's and refuses a file where the two disagree)
FAMILIES["glm4_moe_lite"] = dataclasses.replace(
    FAMILIES["deepseek_v3"], model_type="glm4_moe_lite", hf_rmsnorm="Glm4MoeLiteRMSNorm",
    # transformers' Glm4MoeLiteConfig defaults, for a config.json that leaves a key out
    config_defaults={"first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                     "routed_scaling_factor": 1.8, "norm_topk_prob": True, "rope_interleave": True,
                     "q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
                     "v_head_dim": 256, "attention_bias": False, "rms_norm_eps": 1e-5})

# MiMo-7B (Base, SFT, RL): Qwen2's decoder plus multi-token-prediction layers under its own names (SGLang's MiMoMTP,
# EAGLE's draft: model.mtp_layers.{k}. token_layernorm, hidden_layernorm, input_proj over [hidden; embedding],
# final_layernorm, and a Qwen2 decoder layer); transformers has no mimo classes: Qwen2's run it
_M = "model.mtp_layers.{k}."
FAMILIES["mimo"] = dataclasses.replace(
    FAMILIES["qwen2"], model_type="mimo", transformers_model_type="qwen2", mtp=True, mtp_layer_prefix=_M,
    mtp_own=(ParamMap("mtp.layers.{k}.enorm.weight", (_M + "token_layernorm.weight",), Layout.REPLICATED, _VEC),
             ParamMap("mtp.layers.{k}.hnorm.weight", (_M + "hidden_layernorm.weight",), Layout.REPLICATED, _VEC),
             ParamMap("mtp.layers.{k}.eh_proj.weight", (_M + "input_proj.weight",), Layout.COLUMN_HALVES_SWAPPED,
                      (("hidden", "hidden2"),)),
             ParamMap("mtp.layers.{k}.final_layernorm.weight", (_M + "final_layernorm.weight",), Layout.REPLICATED,
                      _VEC)))

# GLM-5 / GLM-5.1 / GLM-5.2 (744B-A40B; GlmMoeDsaForCausalLM): DeepSeek-V3's multi-latent attention and MoE layout
# with DeepSeek Sparse Attention: a lightning indexer per layer, or shared across layers (GLM-5.2's index_topk_freq /
# index_skip_topk_offset, transformers' indexer_types), picks each query's index_topk keys and the attention reads only
# those (trainer/dsa.py). Interleaved RoPE in the attention and in the indexer: transformers' GlmMoeDsa always
# interleaves both, SGLang reads rope_interleave (absent: interleaved) and indexer_rope_interleave (absent: the two
# halves), so the file must say the indexer's
FAMILIES["glm_moe_dsa"] = dataclasses.replace(
    FAMILIES["deepseek_v3"], model_type="glm_moe_dsa", hf_rmsnorm="GlmMoeDsaRMSNorm",
    required_config={**FAMILIES["deepseek_v3"].required_config, "indexer_rope_interleave": True},
    # transformers' GlmMoeDsaConfig defaults, for a config.json that leaves a key out (rope_interleave and
    # indexer_rope_interleave: SGLang's reading of an absent key, the only reader of either)
    config_defaults={"first_k_dense_replace": 3, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                     "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rope_interleave": True,
                     "indexer_rope_interleave": False, "q_lora_rank": 2048, "kv_lora_rank": 512,
                     "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "attention_bias": False,
                     "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32, "rms_norm_eps": 1e-5,
                     "max_position_embeddings": 202752},
    dsa=True, indexer_params=_INDEXER, slime_spec=("slime_plugins.models.glm5.glm5", "get_glm5_spec"))

# Kimi-K2 (Instruct, Thinking): DeepSeek-V3's architecture under its own model_type (384 experts, one group)
FAMILIES["kimi_k2"] = dataclasses.replace(FAMILIES["deepseek_v3"], model_type="kimi_k2",
                                          transformers_model_type="deepseek_v3")


# model types close to a built family that are not built, and why (preflight adds it to its refusal)
NOT_BUILT: dict[str, str] = {}


def transformers_config(cfg: dict[str, Any]) -> Any:
    """transformers' config object of a config.json dict, through the family's transformers_model_type when
    transformers does not know the file's model_type (Kimi-K2)."""
    from transformers import AutoConfig

    family = FAMILIES.get(cfg.get("model_type", ""))
    model_type = (family.transformers_model_type if family else None) or cfg["model_type"]
    return AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "model_type"})


def get_family(model_type: str, where: str = "config.json") -> Family:
    if model_type not in FAMILIES:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported; supported model types: "
                         f"{sorted(FAMILIES)} (a new family is a Family in slime_rl/config/families.py and its tiny "
                         "checkpoint in tools/make_tiny_model.py)")
    return FAMILIES[model_type]
