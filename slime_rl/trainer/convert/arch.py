"""The architecture of an HF checkpoint, read from its config.json, in Megatron's terms.

Every field below is derived from config.json, and a config this code cannot reproduce exactly
(sliding window, o_proj bias, rope scaling) raises. slime's MODEL_ARGS (Megatron-LM's architecture
flags) build nothing: preflight compares them with this (model_args.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_rl.config.families import Family, ParamMap, get_family
from slime_rl.trainer.convert.vision import VisionArch, vision_arch


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    norm_eps: float
    rotary_base: float
    max_position_embeddings: int
    vocab_size: int  # the HF vocabulary; log-probs never put mass outside it
    padded_vocab_size: int  # rows of Megatron's embedding/output layer (a multiple of TP)
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_layernorm: bool
    # vision-language models: the (t, h, w) split of the rotary channels, and the vision tower
    mrope_section: tuple[int, ...] | None = None
    vision: VisionArch | None = None
    # the sections interleave over the rotary frequencies (Qwen3.5, Family.mrope_interleaved; trainer/vision.py's
    # InterleavedMultimodalRotaryEmbedding) rather than following each other (Qwen2.5-VL)
    mrope_interleaved: bool = False
    # mixture of experts (Family.moe): routed experts per layer (0: dense), experts per token, one
    # expert's width, and whether the top-k probabilities are renormalised to sum to 1 (HF's
    # norm_topk_prob: softmax over all experts, top-k, divide by their sum)
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = False
    # per layer, whether its MLP is the MoE block (HF: not in mlp_only_layers and (i + 1) divisible by
    # decoder_sparse_step); () for a dense model. The shared expert's width (Qwen2-MoE; 0: none).
    moe_layers: tuple[bool, ...] = ()
    moe_shared_expert_ffn_hidden_size: int = 0
    # DeepSeek-style routers (Family.deepseek_moe): sigmoid scores, a selection bias (expert_bias),
    # group-limited top-k (moe_num_groups groups, moe_group_topk chosen; 0: all experts at once) and
    # the weights times moe_scaling_factor (routed_scaling_factor)
    moe_score_function: str = "softmax"
    moe_expert_bias: bool = False
    moe_num_groups: int = 0
    moe_group_topk: int = 0
    moe_scaling_factor: float | None = None
    # the share of each head's channels that rotate (partial_rotary_factor; GLM-4.5: 0.5)
    rotary_percent: float = 1.0
    # the rotary channels rotate in interleaved pairs (GLM-4: Family.rotary_interleaved), and the layers carry a
    # norm after attention and one after the MLP (GLM-4: Family.post_norms)
    rotary_interleaved: bool = False
    post_norms: bool = False
    # the q/k norms span all heads' channels together (MiniMax-M2: Family.qk_norm_whole), not each head's
    qk_norm_whole: bool = False
    # multi-latent attention (Family.mla; 0: none): the query's low-rank width (0: one q_proj), the key/value
    # latent's width, each head's query/key width without and with rotary positions, each head's value width
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # YaRN on multi-latent attention's rotary channels (DeepSeek-V3, Kimi-K2): factor (0: default RoPE),
    # the pretraining context, beta_fast / beta_slow, mscale / mscale_all_dim as megatron's MLA reads them
    yarn_factor: float = 0.0
    yarn_original_max_position_embeddings: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    # multi-token-prediction layers the checkpoint holds after the decoder (num_nextn_predict_layers), and how many
    # of them the trainer builds (--mtp-num-layers, `with_mtp`; 0: their tensors are read past, never sent)
    mtp_layers: int = 0
    mtp_built: int = 0
    # hybrid linear attention (Family.gated_delta_net, Qwen3-Next): per layer whether it is a GatedDeltaNet (HF
    # layer_types "linear_attention"); its key/value head counts and widths and its convolution's width; the full
    # attention's sigmoid output gate (megatron's attention_output_gate); RMSNorms that scale by 1 + w
    # (layernorm_zero_centered_gamma)
    linear_layers: tuple[bool, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    attention_output_gate: bool = False
    zero_centered_norms: bool = False
    # DeepSeek Sparse Attention (Family.dsa, glm_moe_dsa; 0: none): the keys each query attends to (index_topk), the
    # lightning indexer's heads and head width, and per layer whether it runs its own indexer (transformers'
    # indexer_types "full") or reuses the top-k of the last one before it ("shared")
    dsa_index_topk: int = 0
    dsa_index_heads: int = 0
    dsa_index_head_dim: int = 0
    dsa_indexer_layers: tuple[bool, ...] = ()
    # layers of each pipeline stage when the split is uneven (--decoder-first/last-pipeline-num-layers,
    # config/pipeline.py); () for the even split
    pipeline_layers: tuple[int, ...] = ()

    def stage_layers(self, pp_rank: int, pp_size: int) -> tuple[int, int]:
        """(global index of the first layer, number of layers) of pipeline stage `pp_rank`."""
        if self.pipeline_layers:
            if len(self.pipeline_layers) != pp_size:
                raise ValueError(f"the pipeline split {list(self.pipeline_layers)} is for "
                                 f"{len(self.pipeline_layers)} stages, not --pipeline-model-parallel-size {pp_size}")
            return sum(self.pipeline_layers[:pp_rank]), self.pipeline_layers[pp_rank]
        if self.num_layers % pp_size != 0:
            raise ValueError(f"num_hidden_layers={self.num_layers} is not divisible by "
                             f"--pipeline-model-parallel-size {pp_size} (give the first and last stages their "
                             "layers with --decoder-first/last-pipeline-num-layers)")
        per_stage = self.num_layers // pp_size
        return pp_rank * per_stage, per_stage

    def has_indexer(self, i: int) -> bool:
        return bool(self.dsa_indexer_layers) and self.dsa_indexer_layers[i]

    def is_linear_layer(self, i: int) -> bool:
        return bool(self.linear_layers) and self.linear_layers[i]

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.num_experts) and (not self.moe_layers or self.moe_layers[i])

    @property
    def family(self) -> Family:
        return get_family(self.model_type)

    def layer_maps(self, i: int) -> tuple[ParamMap, ...]:
        """The registry entries of global layer i (its MLP dense or MoE; q/k norms and MLA's query
        projections as the config says)."""
        return self.family.layer_maps(self.is_moe_layer(i), self.qk_layernorm, self.q_lora_rank > 0,
                                      self.is_linear_layer(i), self.has_indexer(i))

    def param_maps(self) -> list[ParamMap]:
        """Every tensor of the model as one rank would hold it (Family.param_maps for this config), the built
        multi-token-prediction layers (`mtp_maps`, experts expanded) between the decoder and the final norm."""
        maps = self.family.param_maps(self.num_layers, self.tie_word_embeddings, self.num_experts, self.moe_layers,
                                      self.qk_layernorm, self.q_lora_rank > 0, self.linear_layers,
                                      self.dsa_indexer_layers)
        if not self.mtp_built:
            return maps
        tail = sum(1 for p in self.family.global_params if not p.mcore.startswith("embedding.")
                   and not (p.untied_only and self.tie_word_embeddings))
        mtp = [e for p in self.mtp_maps() for e in p.expand_experts(self.num_experts)]
        return maps[:len(maps) - tail] + mtp + maps[len(maps) - tail:]

    def mtp_maps(self) -> list[ParamMap]:
        """The entries of the built multi-token-prediction layers (Family.mtp_maps; expert entries unexpanded):
        each holds the decoder layer of an MoE layer (a dense one in a dense family), as HF's and SGLang's do."""
        layer = self.family.layer_maps(bool(self.num_experts), self.qk_layernorm, self.q_lora_rank > 0)
        return [p for k in range(self.mtp_built) for p in self.family.mtp_maps(self.num_layers, k, layer)]

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def vision_params(self) -> tuple[ParamMap, ...]:
        return self.vision.params if self.vision is not None else ()


def read_hf_config(checkpoint_dir: str | Path) -> dict[str, Any]:
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--hf-checkpoint {checkpoint_dir}: no config.json there")
    return json.loads(path.read_text())


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def _rope_theta(cfg: dict[str, Any], where: str, yarn: bool = False) -> float:
    # transformers 5 writes rope_parameters = {rope_theta, rope_type}; older configs a flat key.
    params = _rope_params(cfg)
    rope_type = params.get("rope_type", params.get("type", "default"))
    # Qwen2-VL / 2.5-VL hub configs say rope_scaling {"type": "mrope", "mrope_section": ...}: that is
    # default RoPE frequencies with 3-D positions (transformers maps it to "default" too)
    if rope_type not in ("default", "mrope") and not (yarn and rope_type == "yarn"):
        raise ValueError(f"{where}: rope_type {rope_type!r} is not supported (only 'default' RoPE"
                         + (", and 'yarn' for multi-latent attention)" if yarn else ")"))
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{where}: neither rope_parameters.rope_theta nor rope_theta is set")
    return float(theta)


def arch_from_hf_config(cfg: dict[str, Any], tp_size: int = 1, pad_vocab_multiple: int = 1,
                        where: str = "config.json") -> ModelArch:
    """Derive the Megatron architecture; `pad_vocab_multiple` pads the vocab to a multiple of
    pad_vocab_multiple * tp_size (Megatron's --make-vocab-size-divisible-by)."""
    family = get_family(cfg.get("model_type", ""), where)
    built_vision = family.builds_vision(cfg)  # (Qwen3.5 without vision_config: the text decoder alone)
    vision = vision_arch(cfg, where, family.vision_prefix) if built_vision else None
    mrope = None
    if family.vision or family.text_config:
        # transformers 5 nests the decoder's fields in text_config; hub configs keep them at the top (Qwen3.5's
        # nest them too)
        cfg = {**cfg, **(cfg.get("text_config") or {})}
    if built_vision:
        mrope = _rope_params(cfg).get("mrope_section") or family.mrope_default
        if not mrope:
            raise ValueError(f"{where}: a {family.model_type} config needs rope_parameters.mrope_section "
                             "(or rope_scaling.mrope_section)")
    if family.moe:  # hub configs write mlp_only_layers: null as often as []; norm_topk_prob: the family's default
        cfg = {**cfg, "mlp_only_layers": cfg.get("mlp_only_layers") or [],
               "norm_topk_prob": family.config_value(cfg, "norm_topk_prob", False)}
    for key, allowed in family.required_config.items():
        value = cfg.get(key, family.config_defaults.get(key, allowed))
        if value != allowed:
            said = f"{key}={value!r}" if key in cfg else f"{key} absent (read as {value!r})"
            raise ValueError(f"{where}: {said} is not supported for model_type "
                             f"{family.model_type!r} (needs {allowed!r})")
    heads = int(cfg["num_attention_heads"])
    groups = int(family.config_value(cfg, "num_key_value_heads") or heads)
    hidden = int(cfg["hidden_size"])
    if family.mla and groups != heads:
        raise ValueError(f"{where}: num_key_value_heads={groups} must equal num_attention_heads={heads} for "
                         "multi-latent attention (each head expands its own key and value from the latent)")
    if groups % tp_size != 0:
        raise ValueError(f"{where}: num_key_value_heads={groups} is not divisible by "
                         f"--tensor-model-parallel-size {tp_size}; each TP rank must own whole "
                         "query groups")
    vocab = int(cfg["vocab_size"])
    multiple = pad_vocab_multiple * tp_size
    moe = {}
    if family.deepseek_moe:
        moe = _deepseek_moe_fields(cfg, family, where, int(cfg["num_hidden_layers"]))
    elif family.model_type == "minimax_m2":
        moe = _minimax_moe_fields(cfg, family, where, int(cfg["num_hidden_layers"]))
    elif family.moe:
        if not family.dense_layer_params:
            # every layer an MoE block (Qwen3.5-MoE: transformers' Qwen3_5MoeDecoderLayer and SGLang's read neither
            # mlp_only_layers nor decoder_sparse_step); the MoE keys the file leaves out take transformers' defaults,
            # and the dense width megatron never builds is one expert's (slime's --ffn-hidden-size for the 35B-A3B)
            keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
            cfg = {**cfg, **{k: family.config_value(cfg, k) for k in keys}, "mlp_only_layers": [],
                   "decoder_sparse_step": 1}
            cfg["intermediate_size"] = cfg.get("intermediate_size") or cfg["moe_intermediate_size"]
        moe = _moe_fields(cfg, where, int(cfg["num_hidden_layers"]), family.shared_expert)
    qk_norm = family.qk_layernorm if family.qk_norm_key is None else bool(family.config_value(cfg, family.qk_norm_key))
    mla = _mla_fields(cfg, family, where) if family.mla else {}
    linear = _linear_attention_fields(cfg, family, where, int(cfg["num_hidden_layers"]), tp_size) \
        if family.gated_delta_net else {}
    dsa = _dsa_fields(cfg, family, where, int(cfg["num_hidden_layers"]), mla) if family.dsa else {}
    return ModelArch(
        model_type=family.model_type,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=groups,
        # multi-latent attention: a query/key head's width (megatron's MLA reads its own fields)
        kv_channels=(mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"] if mla
                     else int(family.config_value(cfg, "head_dim") or hidden // heads)),
        norm_eps=float(family.config_value(cfg, "rms_norm_eps", 1e-6)),
        rotary_base=_rope_theta(cfg, where, yarn=family.mla),
        max_position_embeddings=int(family.config_value(cfg, "max_position_embeddings", 4096)),
        vocab_size=vocab,
        padded_vocab_size=-(-vocab // multiple) * multiple,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family.default_tied)),
        qkv_bias=family.qkv_bias,
        qk_layernorm=qk_norm,
        rotary_percent=_rotary_percent(cfg, family, where),
        rotary_interleaved=family.rotary_interleaved,
        post_norms=family.post_norms,
        qk_norm_whole=family.qk_norm_whole,
        mtp_layers=_mtp_layers(cfg, family),
        **mla,
        **linear,
        **dsa,
        zero_centered_norms=family.zero_centered_norms,
        **(_yarn_fields(cfg, where) if family.mla else {}),
        mrope_section=tuple(int(x) for x in mrope) if mrope else None,
        mrope_interleaved=bool(mrope) and family.mrope_interleaved,
        vision=vision,
        **moe,
    )


def _moe_fields(cfg: dict[str, Any], where: str, num_layers: int = 0, shared_expert: bool = False) -> dict[str, Any]:
    """ModelArch's MoE fields from a Qwen-MoE config.json. The hub's configs name the expert count
    num_experts; transformers 5 writes it back as num_local_experts (its attribute map)."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    missing = [k for k, v in (("num_experts", experts), ("num_experts_per_tok", cfg.get("num_experts_per_tok")),
                              ("moe_intermediate_size", cfg.get("moe_intermediate_size"))) if v is None]
    if missing:
        raise ValueError(f"{where}: model_type {cfg.get('model_type')!r} needs {missing} (mixture of experts)")
    experts, topk = int(experts), int(cfg["num_experts_per_tok"])
    if not 1 <= topk <= experts:
        raise ValueError(f"{where}: num_experts_per_tok={topk} must be in [1, num_experts={experts}]")
    out = {"num_experts": experts, "moe_topk": topk, "moe_ffn_hidden_size": int(cfg["moe_intermediate_size"]),
           "moe_norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
           "moe_layers": _moe_layer_pattern(cfg, where, num_layers)}
    if shared_expert:
        shared = cfg.get("shared_expert_intermediate_size")
        if not isinstance(shared, int) or shared <= 0:
            raise ValueError(f"{where}: model_type {cfg.get('model_type')!r} needs shared_expert_intermediate_size > 0 "
                             f"(the shared expert's width), got {shared!r}")
        out["moe_shared_expert_ffn_hidden_size"] = shared
    return out


def _linear_attention_fields(cfg: dict[str, Any], family: Family, where: str, num_layers: int,
                             tp_size: int) -> dict[str, Any]:
    """ModelArch's hybrid fields from a Qwen3-Next config.json: the layer kinds from layer_types (transformers 5
    writes it) or else full_attention_interval (the hub's file: layer i is full attention when (i + 1) is a multiple
    of it, transformers' reading), the GatedDeltaNet's heads and widths (transformers' defaults where the file leaves
    them out), and the full attention's output gate. TP splits the key heads (and with them their value heads)."""
    value = family.config_value
    types = cfg.get("layer_types")
    if types is None:
        interval = value(cfg, "full_attention_interval")
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f"{where}: full_attention_interval={interval!r} must be an integer >= 1")
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"{where}: layer_types={types!r} must name 'linear_attention' or 'full_attention' for each "
                         f"of the {num_layers} layers")
    out = {k: int(value(cfg, k)) for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                           "linear_value_head_dim", "linear_conv_kernel_dim")}
    bad = [k for k, v in out.items() if v <= 0]
    if bad:
        raise ValueError(f"{where}: {bad} must be positive integers (Gated DeltaNet)")
    keys, values = out["linear_num_key_heads"], out["linear_num_value_heads"]
    if values % keys:
        raise ValueError(f"{where}: linear_num_value_heads={values} must be a multiple of linear_num_key_heads={keys}")
    if keys % tp_size:
        raise ValueError(f"{where}: linear_num_key_heads={keys} is not divisible by --tensor-model-parallel-size "
                         f"{tp_size}; each TP rank must own whole Gated DeltaNet key heads")
    return {**out, "linear_layers": tuple(t == "linear_attention" for t in types), "attention_output_gate": True}


def _mla_fields(cfg: dict[str, Any], family: Family, where: str) -> dict[str, int]:
    """ModelArch's multi-latent attention fields from a DeepSeek-V3 config.json (transformers' defaults for a
    key the file leaves out; q_lora_rank null: one query projection). The up projections split by heads over
    TP (num_key_value_heads = num_attention_heads, checked with the groups); the down projections are whole
    on every rank."""
    out = family.mla_dims(cfg)
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if out[key] <= 0:
            raise ValueError(f"{where}: {key}={out[key]} must be a positive integer (multi-latent attention)")
    if out["qk_rope_head_dim"] % 2:
        raise ValueError(f"{where}: qk_rope_head_dim={out['qk_rope_head_dim']} must be even (rotary pairs)")
    return out


def dsa_indexer_types(cfg: dict[str, Any], num_layers: int, where: str = "config.json") -> list[str]:
    """Per layer "full" (runs its own indexer) or "shared" (reuses the top-k of the last full layer before it), read
    as transformers' GlmMoeDsaConfig and SGLang's dsa_layer_skips_topk read it: indexer_types, else
    index_topk_pattern ("F"/"S" per layer), else index_topk_freq (default 1) and index_skip_topk_offset (default 2):
    layer i is full where max(i - offset + 1, 0) is a multiple of the frequency."""
    types = cfg.get("indexer_types")
    if types is None and cfg.get("index_topk_pattern") is not None:
        pattern = cfg["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    if types is None:
        freq, offset = cfg.get("index_topk_freq") or 1, cfg.get("index_skip_topk_offset")
        offset = 2 if offset is None else offset
        if not isinstance(freq, int) or freq < 1 or not isinstance(offset, int) or offset < 1:
            raise ValueError(f"{where}: index_topk_freq={freq!r} and index_skip_topk_offset={offset!r} must be "
                             "positive integers")
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]
    types = list(types)
    if len(types) != num_layers or set(types) - {"full", "shared"}:
        raise ValueError(f"{where}: indexer_types={types!r} must name 'full' or 'shared' for each of the {num_layers} "
                         "layers")
    if types[0] != "full":
        raise ValueError(f"{where}: indexer_types starts with {types[0]!r}: the first layer has no indexer before it "
                         "to share")
    return types


def _dsa_fields(cfg: dict[str, Any], family: Family, where: str, num_layers: int, mla: dict[str, int]) -> dict:
    """ModelArch's DeepSeek Sparse Attention fields (transformers' GlmMoeDsaConfig defaults for a key the file leaves
    out). The indexer's query comes from the query latent (q_lora_rank > 0), its first qk_rope_head_dim channels
    rotate with the attention's default RoPE (no YaRN: transformers' indexer would scale the rotation by YaRN's
    attention factor)."""
    out = {"dsa_index_topk": int(family.config_value(cfg, "index_topk", 0)),
           "dsa_index_heads": int(family.config_value(cfg, "index_n_heads", 0)),
           "dsa_index_head_dim": int(family.config_value(cfg, "index_head_dim", 0))}
    for key, value in zip(("index_topk", "index_n_heads", "index_head_dim"), out.values(), strict=True):
        if value <= 0:
            raise ValueError(f"{where}: {key}={value} must be a positive integer (sparse attention's indexer)")
    if not mla["q_lora_rank"]:
        raise ValueError(f"{where}: q_lora_rank must be set for sparse attention (its indexer reads the query latent)")
    if out["dsa_index_head_dim"] < mla["qk_rope_head_dim"]:
        raise ValueError(f"{where}: index_head_dim={out['dsa_index_head_dim']} is narrower than qk_rope_head_dim="
                         f"{mla['qk_rope_head_dim']} (the indexer rotates its first qk_rope_head_dim channels)")
    params = _rope_params(cfg)
    if params.get("rope_type", params.get("type", "default")) != "default":
        raise ValueError(f"{where}: rope_type {params.get('rope_type', params.get('type'))!r} is not supported for "
                         f"model_type {family.model_type!r} (only 'default' RoPE with sparse attention)")
    dense = cfg.get("mlp_layer_types")
    if dense is not None:  # transformers builds from mlp_layer_types, SGLang from first_k_dense_replace
        first = family.config_value(cfg, "first_k_dense_replace", 0)
        if list(dense) != ["dense"] * first + ["sparse"] * (num_layers - first):
            raise ValueError(f"{where}: mlp_layer_types {list(dense)} (what transformers builds) and "
                             f"first_k_dense_replace={first} (what SGLang builds) give different dense layers; make "
                             "them agree")
    types = dsa_indexer_types(cfg, num_layers, where)
    return {**out, "dsa_indexer_layers": tuple(t == "full" for t in types)}


def check_dsa_stages(indexer_layers: tuple[bool, ...], stage_starts: list[int]) -> None:
    """A pipeline stage must start on a layer with its own indexer (a shared layer's source would be on another
    stage); ValueError naming the flags otherwise."""
    bad = [i for i in stage_starts if not indexer_layers[i]]
    if bad:
        full = [i for i, f in enumerate(indexer_layers) if f]
        raise ValueError(f"sparse attention: pipeline stages start at layers {stage_starts}, and layer(s) {bad} reuse "
                         "an earlier layer's top-k (indexer_types 'shared'), which another stage computes; split the "
                         "layers with --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers (or "
                         f"another --pipeline-model-parallel-size) so that every stage starts on one of {full}")


def _yarn_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelArch's YaRN fields from rope_parameters / rope_scaling of type yarn (none for default RoPE), read as
    transformers' _compute_yarn_parameters and yarn_apply_mscale read them: factor (absent: max_position_embeddings
    / original_max_position_embeddings), beta_fast 32 / beta_slow 1 where absent, the cos/sin concentration
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set and non-zero, else mscale(factor),
    and the softmax scale times mscale(factor, mscale_all_dim)^2 when mscale_all_dim is set. megatron's
    YarnRotaryEmbedding computes the same from (mscale, mscale_all_dim) = (1, 0) in the second case."""
    params = _rope_params(cfg)
    if params.get("rope_type", params.get("type", "default")) != "yarn":
        return {}
    for key in ("attention_factor",):
        if params.get(key) is not None:
            raise ValueError(f"{where}: rope_parameters.{key}={params[key]!r} is not supported for YaRN (the "
                             "concentration comes from factor, mscale and mscale_all_dim)")
    if params.get("truncate", True) is not True:
        raise ValueError(f"{where}: rope_parameters.truncate={params['truncate']!r} is not supported (megatron "
                         "rounds YaRN's correction range to integers)")
    original = params.get("original_max_position_embeddings")
    if not original:
        raise ValueError(f"{where}: YaRN needs rope_parameters.original_max_position_embeddings")
    factor = params.get("factor")
    factor = float(factor) if factor is not None else int(cfg.get("max_position_embeddings", 0)) / int(original)
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    both = bool(mscale) and bool(all_dim)
    return {"yarn_factor": factor, "yarn_original_max_position_embeddings": int(original),
            "yarn_beta_fast": float(params.get("beta_fast") or 32),
            "yarn_beta_slow": float(params.get("beta_slow") or 1),
            "yarn_mscale": float(mscale) if both else 1.0, "yarn_mscale_all_dim": float(all_dim) if both else 0.0}


def _mtp_layers(cfg: dict[str, Any], family: Family) -> int:
    """The multi-token-prediction layers after the decoder: num_nextn_predict_layers, or MiniMax-M2's
    num_mtp_modules under use_mtp."""
    if family.model_type == "minimax_m2":
        return int(cfg.get("num_mtp_modules") or 0) if cfg.get("use_mtp") else 0
    return int(cfg.get("num_nextn_predict_layers") or 0)


def with_mtp(arch: ModelArch, num_layers: int | None, where: str = "config.json") -> ModelArch:
    """The arch with `num_layers` multi-token-prediction layers built (--mtp-num-layers; None or 0: none). ValueError
    naming the flag and config.json's key when the family has none or the checkpoint holds fewer."""
    if not num_layers:
        return arch
    key = "num_mtp_modules" if arch.model_type == "minimax_m2" else "num_nextn_predict_layers"
    if not arch.family.mtp:
        raise ValueError(f"--mtp-num-layers {num_layers}: model_type {arch.model_type!r} has no multi-token-prediction "
                         "layers the trainer builds (deepseek_v3, glm4_moe_lite, kimi_k2, mimo)")
    if num_layers > arch.mtp_layers:
        raise ValueError(f"--mtp-num-layers {num_layers}: {where} has {key} {arch.mtp_layers}, so the checkpoint holds "
                         f"{'no' if not arch.mtp_layers else f'only {arch.mtp_layers}'} multi-token-prediction "
                         f"layer(s) to build (a checkpoint with them has {key} >= {num_layers} and their tensors "
                         f"{arch.family.mtp_layer_prefix.replace('{k}', '0') or f'model.layers.{arch.num_layers}.'}*)")
    return dataclasses.replace(arch, mtp_built=num_layers)


def _minimax_rotary_percent(cfg: dict[str, Any], family: Family, where: str) -> float:
    """MiniMax-M2 rotates the first rotary_dim channels of each head: SGLang reads rotary_dim (absent: the whole
    head), transformers rotary_dim / head_dim unless rope_parameters gives partial_rotary_factor; a file where the
    two would differ is refused."""
    head_dim = int(family.config_value(cfg, "head_dim"))
    rotary_dim = cfg.get("rotary_dim")
    if rotary_dim is not None and (not isinstance(rotary_dim, int) or not 0 < rotary_dim <= head_dim
                                   or rotary_dim % 2):
        raise ValueError(f"{where}: rotary_dim={rotary_dim!r} must be an even integer in (0, head_dim={head_dim}]")
    factor = rotary_dim / head_dim if rotary_dim is not None else 1.0
    stated = cfg.get("partial_rotary_factor", _rope_params(cfg).get("partial_rotary_factor"))
    if stated is not None and float(stated) != factor:
        raise ValueError(f"{where}: partial_rotary_factor={stated} (what transformers rotates) differs from "
                         + (f"rotary_dim / head_dim = {rotary_dim} / {head_dim}" if rotary_dim is not None else
                            "no rotary_dim (SGLang rotates the whole head)")
                         + " (what SGLang rotates); make them agree")
    return factor


def _rotary_percent(cfg: dict[str, Any], family: Family, where: str) -> float:
    """partial_rotary_factor (top level or in rope_parameters); transformers' Glm4MoeConfig and Glm4Config set 0.5
    when the file has none; MiniMax-M2's rotary_dim (_minimax_rotary_percent). Other families rotate whole heads
    and refuse a factor below 1."""
    if family.model_type == "minimax_m2":
        return _minimax_rotary_percent(cfg, family, where)
    factor = cfg.get("partial_rotary_factor", _rope_params(cfg).get("partial_rotary_factor"))
    factor = float(factor if factor is not None else family.config_defaults.get("partial_rotary_factor", 1.0))
    if not 0 < factor <= 1:
        raise ValueError(f"{where}: partial_rotary_factor={factor} must be in (0, 1]")
    if factor != 1.0 and "partial_rotary_factor" not in family.config_defaults:
        raise ValueError(f"{where}: partial_rotary_factor={factor} is not supported for model_type "
                         f"{family.model_type!r} (its heads rotate whole)")
    return factor


def _deepseek_moe_fields(cfg: dict[str, Any], family: Family, where: str, num_layers: int) -> dict[str, Any]:
    """ModelArch's MoE fields from a DeepSeek-V3-style config.json (GLM-4.5 too): n_routed_experts
    (transformers 5 may write num_local_experts), n_shared_experts of moe_intermediate_size, the first
    first_k_dense_replace layers dense, a sigmoid router with e_score_correction_bias, n_group /
    topk_group and routed_scaling_factor. megatron's group-limited top-k scores a group by the sum of
    its top num_experts_per_tok / topk_group experts, transformers' by its top 2: the two agree only when
    that quotient is 2 (DeepSeek-V3: 8 / 4), or with one group."""
    mt = cfg.get("model_type")
    experts = cfg.get("n_routed_experts", cfg.get("num_local_experts"))
    missing = [k for k, v in (("n_routed_experts", experts), ("num_experts_per_tok", cfg.get("num_experts_per_tok")),
                              ("moe_intermediate_size", cfg.get("moe_intermediate_size"))) if v is None]
    if missing:
        raise ValueError(f"{where}: model_type {mt!r} needs {missing} (mixture of experts)")
    experts, topk, width = int(experts), int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"])
    if not 1 <= topk <= experts:
        raise ValueError(f"{where}: num_experts_per_tok={topk} must be in [1, n_routed_experts={experts}]")
    value = family.config_value  # transformers' default where the file leaves a key out
    groups, group_topk = int(value(cfg, "n_group", 1)), int(value(cfg, "topk_group", 1))
    if groups < 1 or experts % groups:
        raise ValueError(f"{where}: n_group={groups} must divide n_routed_experts={experts}")
    if not 1 <= group_topk <= groups:
        raise ValueError(f"{where}: topk_group={group_topk} must be in [1, n_group={groups}]")
    if groups > 1 and (topk % group_topk or topk // group_topk != 2 or experts // groups < 2):
        raise ValueError(f"{where}: n_group={groups} with topk_group={group_topk} and num_experts_per_tok={topk}: "
                         "transformers scores each group by its top 2 experts, megatron-core's group-limited "
                         f"routing by its top num_experts_per_tok / topk_group = {topk / group_topk:g}; only "
                         "configs where that is 2 (DeepSeek-V3: 8 / 4) or with n_group 1 train the model the "
                         "engine runs")
    shared = int(value(cfg, "n_shared_experts", 0))
    dense = value(cfg, "first_k_dense_replace", 0)
    if not isinstance(dense, int) or not 0 <= dense < num_layers:
        raise ValueError(f"{where}: first_k_dense_replace={dense!r} must be an integer in [0, "
                         f"num_hidden_layers={num_layers}) (transformers' default for {family.model_type}: "
                         f"{family.config_defaults.get('first_k_dense_replace', 0)}); a model without MoE layers is "
                         "a dense family")
    layers = tuple(i >= dense for i in range(num_layers))
    if mt == "glm4_moe_lite":  # transformers builds from mlp_layer_types (default: the first dense), SGLang as above
        if "head_dim" in cfg and cfg["head_dim"] != cfg.get("qk_rope_head_dim"):
            raise ValueError(f"{where}: head_dim={cfg['head_dim']} differs from qk_rope_head_dim="
                             f"{cfg.get('qk_rope_head_dim')}: transformers' Glm4MoeLiteConfig reads head_dim as "
                             "qk_rope_head_dim; give one value")
        types = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (num_layers - 1)
        if len(types) != num_layers or set(types) - {"dense", "sparse"}:
            raise ValueError(f"{where}: mlp_layer_types={types!r} must name 'dense' or 'sparse' for each of the "
                             f"{num_layers} layers")
        if tuple(t == "sparse" for t in types) != layers:
            raise ValueError(f"{where}: mlp_layer_types {types} (what transformers builds) and first_k_dense_replace="
                             f"{dense} (what SGLang builds) give different dense layers; make them agree")
    scaling = float(value(cfg, "routed_scaling_factor", 1.0))
    if topk == 1:
        raise ValueError(f"{where}: num_experts_per_tok=1 with a sigmoid router: megatron-core skips the "
                         "renormalisation transformers does (norm_topk_prob) for a single expert")
    return {"num_experts": experts, "moe_topk": topk, "moe_ffn_hidden_size": width, "moe_norm_topk_prob": True,
            "moe_layers": layers,
            "moe_shared_expert_ffn_hidden_size": shared * width,
            "moe_score_function": "sigmoid", "moe_expert_bias": True,
            "moe_num_groups": groups if groups > 1 else 0, "moe_group_topk": group_topk if groups > 1 else 0,
            "moe_scaling_factor": scaling}


def _minimax_moe_fields(cfg: dict[str, Any], family: Family, where: str, num_layers: int) -> dict[str, Any]:
    """ModelArch's MoE fields from a MiniMax-M2 config.json: every layer num_local_experts experts of
    intermediate_size, top num_experts_per_tok chosen by sigmoid + e_score_correction_bias, the chosen sigmoid
    scores renormalised, no scaling, no groups, no shared expert (shared_intermediate_size 0)."""
    # transformers' MiniMaxM2Config reads num_experts as num_local_experts (its attribute map)
    experts = int(cfg.get("num_experts") or family.config_value(cfg, "num_local_experts"))
    topk = int(family.config_value(cfg, "num_experts_per_tok"))
    width = int(cfg["intermediate_size"])
    if not 1 <= topk <= experts:
        raise ValueError(f"{where}: num_experts_per_tok={topk} must be in [1, num_local_experts={experts}]")
    if topk == 1:
        raise ValueError(f"{where}: num_experts_per_tok=1 with a sigmoid router: megatron-core skips the "
                         "renormalisation transformers and SGLang do for a single expert")
    if cfg.get("shared_intermediate_size"):
        raise ValueError(f"{where}: shared_intermediate_size={cfg['shared_intermediate_size']}: MiniMax-M2 has no "
                         "shared expert (transformers and SGLang build none); 0 is the only value supported")
    return {"num_experts": experts, "moe_topk": topk, "moe_ffn_hidden_size": width, "moe_norm_topk_prob": True,
            "moe_layers": tuple(True for _ in range(num_layers)), "moe_score_function": "sigmoid",
            "moe_expert_bias": True, "moe_scaling_factor": 1.0}


def _moe_layer_pattern(cfg: dict[str, Any], where: str, num_layers: int) -> tuple[bool, ...]:
    """Per layer, whether transformers builds the sparse MoE block there (Qwen2MoeDecoderLayer /
    Qwen3MoeDecoderLayer: `i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0`)."""
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"{where}: decoder_sparse_step={step!r} must be an integer >= 1")
    dense = cfg.get("mlp_only_layers") or []
    bad = [i for i in dense if not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{where}: mlp_only_layers={dense!r}: {bad} are not layer indices in "
                         f"[0, num_hidden_layers={num_layers})")
    pattern = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    if num_layers and not any(pattern):
        raise ValueError(f"{where}: mlp_only_layers={dense!r} with decoder_sparse_step={step} leave no MoE layer; "
                         "a model without experts is a dense family (qwen2 / qwen3)")
    return pattern


def load_arch(checkpoint_dir: str | Path, tp_size: int = 1, pad_vocab_multiple: int = 1) -> ModelArch:
    return arch_from_hf_config(read_hf_config(checkpoint_dir), tp_size, pad_vocab_multiple,
                               where=f"{checkpoint_dir}/config.json")


def hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """The shape config.json implies for every HF tensor of the model (unpadded vocab), in the
    registry's order; a checkpoint whose tensors differ belongs to another config."""
    size = {"vocab": arch.vocab_size, "hidden": arch.hidden_size, "ffn": arch.ffn_hidden_size,
            "q": arch.num_attention_heads * arch.kv_channels, "kv": arch.num_query_groups * arch.kv_channels,
            "head": arch.kv_channels, "experts": arch.num_experts, "moe_ffn": arch.moe_ffn_hidden_size,
            "shared_ffn": arch.moe_shared_expert_ffn_hidden_size, "one": 1, "gate_up": 2 * arch.ffn_hidden_size,
            "q_lora": arch.q_lora_rank, "kv_lora": arch.kv_lora_rank,
            "kv_down": arch.kv_lora_rank + arch.qk_rope_head_dim,
            "q_up": arch.num_attention_heads * (arch.qk_nope_head_dim + arch.qk_rope_head_dim),
            "kv_up": arch.num_attention_heads * (arch.qk_nope_head_dim + arch.v_head_dim),
            "o_in": arch.num_attention_heads * arch.v_head_dim,
            "q_gate": 2 * arch.num_attention_heads * arch.kv_channels,
            "gdn_qkvz": 2 * arch.linear_num_key_heads * arch.linear_key_head_dim
            + 2 * arch.linear_num_value_heads * arch.linear_value_head_dim,
            "gdn_ba": 2 * arch.linear_num_value_heads,
            "gdn_conv": 2 * arch.linear_num_key_heads * arch.linear_key_head_dim
            + arch.linear_num_value_heads * arch.linear_value_head_dim,
            "gdn_heads": arch.linear_num_value_heads, "gdn_vhead": arch.linear_value_head_dim,
            "gdn_v": arch.linear_num_value_heads * arch.linear_value_head_dim,
            "conv_kernel": arch.linear_conv_kernel_dim, "hidden2": 2 * arch.hidden_size,
            "idx_q": arch.dsa_index_heads * arch.dsa_index_head_dim, "idx_head": arch.dsa_index_head_dim,
            "idx_heads": arch.dsa_index_heads}
    out: dict[str, tuple[int, ...]] = {pm.hf[0]: pm.shapes[0] for pm in arch.vision_params}  # concrete sizes
    for pm in arch.param_maps():
        assert len(pm.shapes) == len(pm.hf), f"registry entry {pm.mcore}: one shape per HF name"
        for name, dims in zip(pm.hf, pm.shapes, strict=True):
            out[name] = tuple(size[d] for d in dims)
    return out
