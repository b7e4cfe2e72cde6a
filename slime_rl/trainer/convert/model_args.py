"""slime's MODEL_ARGS against what the trainer builds from config.json.

slime's launch scripts describe the model to Megatron-LM in flags (scripts/models/*.sh); the trainer
builds it from --hf-checkpoint's config.json (`ModelArch`, the family's features). The flags are
kept as given (`ModelConfig.megatron_model_args`, config/flags_model.py) and each is read the way
Megatron-LM reads it (megatron/training/arguments.py): what model would Megatron-LM build from it?
That is compared with the trainer's model; a flag that describes another model is a `Mismatch`.

What is compared: every flag given that has a shape meaning. A flag absent is compared only in a
whole MODEL_ARGS (--num-layers, --hidden-size and --num-attention-heads given: what Megatron-LM
needs to build a model) and only where slime's model files rely on Megatron-LM's default by leaving
the flag out (tied embeddings, no q/k/v bias, no q/k norm, one key/value head per query head, a
dense MLP, no shared expert, softmax after the top-k, head width hidden / heads, norm epsilon
1e-05, no norms after attention and the MLP, the two halves of each head rotating, norms that scale by w, no
output gate on attention) or slime's own
config.json check compares the default (rotary base 10000, slime/backends/megatron_utils/arguments.py).
Switches every slime model file gives (--swiglu, --disable-bias-linear, the position embedding,
--normalization) are compared only when given.
Flags Megatron-LM reads only together with another (--num-query-groups without
--group-query-attention, MoE settings on a dense model without --num-experts) are read the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime_rl.trainer.convert.arch import ModelArch

# what Megatron-LM requires to build a model (arguments.py validate_args' required_args, less
# --max-position-embeddings, which slime fills in itself): given together, MODEL_ARGS is whole
WHOLE = ("--num-layers", "--hidden-size", "--num-attention-heads")
# the switches no family here has: flag -> what the family lacks
_NO_FAMILY_HAS = {
    "--use-rope-scaling": "RoPE scaling (no rope_scaling: default RoPE)",
    "--moe-router-enable-expert-bias": "expert bias in its routers (e_score_correction_bias)",
}


@dataclass(frozen=True)
class Mismatch:
    claim: str  # what MODEL_ARGS says, in its flags: "--num-layers 36", "no --qk-layernorm (...)"
    truth: str  # what config.json says, with its key: "num_hidden_layers 28"
    # the flags may well be for this checkpoint, but ask for what the trainer does not build (slime's vision-language
    # model provider of a family whose text decoder alone is built): no "another model?" question after it
    other_model: bool = True


def fmt(value: Any) -> str:
    """A value as a message shows it: integral floats as integers (rope_theta 1000000.0 -> 1000000),
    lists of layers in Megatron-LM's notation."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer() and abs(value) >= 1:
        return str(int(value))
    if isinstance(value, (list, tuple)) and all(isinstance(x, int) for x in value):
        return layer_pattern(list(value))
    return str(value)


def layer_pattern(layers: list[int]) -> str:
    """[0, 1, 1, 1] -> "[0]*1+[1]*3", a repeated period -> "([1]*1+[0]*1)*24" (Megatron-LM's notation)."""
    def runs(xs: list[int]) -> str:
        out: list[list[int]] = []
        for x in xs:
            if out and out[-1][0] == x:
                out[-1][1] += 1
            else:
                out.append([x, 1])
        return "+".join(f"[{x}]*{n}" for x, n in out)

    if not layers:
        return "[]"
    n = len(layers)
    for p in range(1, n // 2 + 1):
        if n % p == 0 and layers == layers[:p] * (n // p) and runs(layers[:p]).count("+") < runs(layers).count("+"):
            return f"({runs(layers[:p])})*{n // p}"
    return runs(layers)


def megatron_moe_layers(freq: int | list[int], num_layers: int) -> list[int]:
    """Megatron-LM's MoE layer pattern (gpt_layer_specs.get_gpt_decoder_block_spec): an integer N makes
    layer i an MoE layer when i % N == 0; a list is the pattern itself."""
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(num_layers)] if freq > 0 else [0] * num_layers
    return list(freq)


def compare_model_args(given: dict[str, Any], hf: dict[str, Any], arch: ModelArch) -> list[Mismatch]:
    """Each flag of `given` (MODEL_ARGS, flag -> value) that describes another model than `arch`
    (built from the config.json `hf`), in the order of a model file."""
    fam, mt = arch.family, repr(arch.model_type)
    text = {**hf, **(hf.get("text_config") or {})} if fam.vision or fam.text_config else hf
    whole = all(f in given for f in WHOLE)
    out: list[Mismatch] = []

    def compare(flag: str, stated: Any, key: str, actual: Any, claim: str | None = None,
                truth: str | None = None) -> None:
        same = (float(stated) == float(actual) if isinstance(stated, (int, float)) and not isinstance(stated, bool)
                and isinstance(actual, (int, float)) else stated == actual)
        if not same:
            out.append(Mismatch(claim or f"{flag} {fmt(stated)}", truth or f"{key} {fmt(actual)}"))

    def has(flag: str) -> bool:
        return bool(given.get(flag))

    def switch(flag: str, model_has: bool, truth: str, absent: str, read_absent: bool = whole) -> None:
        """A Megatron-LM switch against the model: given where the model lacks what it builds, or left out
        (where its absence is read: a whole MODEL_ARGS) where the model has it (`absent`: what Megatron-LM
        builds then)."""
        if has(flag) and not model_has:
            out.append(Mismatch(flag, truth))
        elif not has(flag) and read_absent and model_has:
            out.append(Mismatch(f"no {flag} ({absent})", truth))

    # ---- sizes
    for flag, key, actual in (("--num-layers", "num_hidden_layers", arch.num_layers),
                              ("--hidden-size", "hidden_size", arch.hidden_size),
                              ("--num-attention-heads", "num_attention_heads", arch.num_attention_heads)):
        if flag in given:
            compare(flag, given[flag], key, actual)
    if "--ffn-hidden-size" in given and (not arch.num_experts or not all(arch.moe_layers)):
        compare("--ffn-hidden-size", given["--ffn-hidden-size"], "intermediate_size", arch.ffn_hidden_size)
    heads, groups = arch.num_attention_heads, arch.num_query_groups
    if has("--group-query-attention"):
        if "--num-query-groups" in given:
            compare("--num-query-groups", given["--num-query-groups"], "num_key_value_heads", groups)
        else:
            compare("--group-query-attention", 1, "num_key_value_heads", groups, claim="--group-query-attention "
                    "without --num-query-groups (Megatron-LM's default: 1 query group)")
    elif (whole or "--num-query-groups" in given) and groups != heads:
        unread = "; --num-query-groups is read only with it" if "--num-query-groups" in given else ""
        out.append(Mismatch("no --group-query-attention (Megatron-LM builds one key/value head per attention "
                            f"head{unread})", f"num_key_value_heads {groups} (of {heads} heads)"))
    head_key = "head_dim" if text.get("head_dim") else "hidden_size / num_attention_heads"
    if arch.mla:  # multi-latent attention reads its own widths (below), not --kv-channels
        pass
    elif "--kv-channels" in given:
        compare("--kv-channels", given["--kv-channels"], head_key, arch.kv_channels)
    elif whole:
        default = given["--hidden-size"] // given["--num-attention-heads"]
        compare("--kv-channels", default, head_key, arch.kv_channels, claim="no --kv-channels (Megatron-LM's default "
                f"--hidden-size / --num-attention-heads = {default})")
    if "--vocab-size" in given:
        compare("--vocab-size", given["--vocab-size"], "vocab_size", arch.vocab_size)
    if "--max-position-embeddings" in given:
        compare("--max-position-embeddings", given["--max-position-embeddings"], "max_position_embeddings",
                arch.max_position_embeddings)
    tied = arch.tie_word_embeddings
    switch("--untie-embeddings-and-output-weights", not tied, f"tie_word_embeddings {fmt(tied)}",
           "Megatron-LM ties the output layer to the embedding")
    if has("--swiglu"):
        compare("--swiglu", "silu", "hidden_act", text.get("hidden_act", "silu"), claim="--swiglu (SiLU)")
    qkv = (f"attention_bias {fmt(text['attention_bias'])}" if "attention_bias" in text else f"model_type {mt}") + \
        (": q/k/v projections with bias" if fam.qkv_bias else ": q/k/v projections without bias")
    if not (arch.mla and has("--multi-latent-attention")):  # Megatron-LM's MLA projections never take a bias,
        # whatever --add-qkv-bias says (slime's glm4.7-30B-A3B.sh gives it): the same model
        switch("--add-qkv-bias", fam.qkv_bias, qkv, "with --disable-bias-linear Megatron-LM builds q/k/v without "
               "bias", read_absent=whole and has("--disable-bias-linear"))
    # ---- norms
    if "--normalization" in given:
        compare("--normalization", given["--normalization"], "", "RMSNorm", truth=f"model_type {mt}, whose norms "
                "are RMSNorm")
    if "--norm-epsilon" in given:
        compare("--norm-epsilon", given["--norm-epsilon"], "rms_norm_eps", arch.norm_eps)
    elif whole:
        compare("--norm-epsilon", 1e-5, "rms_norm_eps", arch.norm_eps,
                claim="no --norm-epsilon (Megatron-LM's default 1e-05)")
    qk_norm = (f"{fam.qk_norm_key} {fmt(arch.qk_layernorm)}" if fam.qk_norm_key else f"model_type {mt}") + ", " + (
        ("with q_norm / k_norm over all heads' channels together (one RMSNorm of the query's heads x head_dim, one "
         "of the key's)" if arch.qk_norm_whole else "with q_norm / k_norm (an RMSNorm of each query and key head)")
        if arch.qk_layernorm else "without q/k norm")
    switch("--qk-layernorm", arch.qk_layernorm, qk_norm, "Megatron-LM builds no q/k norm")
    centred = f"model_type {mt}, " + ("whose RMSNorms store w and scale by 1 + w" if arch.zero_centered_norms
                                      else "whose RMSNorms scale by w")
    switch("--apply-layernorm-1p", arch.zero_centered_norms, centred, "Megatron-LM's norms scale by w")
    post = f"model_type {mt}, " + ("with a norm of the attention's and of the MLP's output before each residual add "
                                   "(post_self_attn_layernorm, post_mlp_layernorm)" if arch.post_norms else
                                   "without norms after attention and the MLP")
    for flag, where in (("--post-self-attn-layernorm", "attention"), ("--post-mlp-layernorm", "the MLP")):
        switch(flag, arch.post_norms, post, f"Megatron-LM builds no norm after {where}")
    # ---- positions
    position = "rope" if has("--use-rotary-position-embeddings") else given.get("--position-embedding-type")
    want = "mrope" if fam.vision else "rope"
    # Qwen3.5: slime's model files say rope and its vision-language provider builds mrope itself; text positions make
    # the two one rotation
    if position is not None and position != want and not (fam.text_config and position == "rope"):
        claim = ("--use-rotary-position-embeddings (rope)" if has("--use-rotary-position-embeddings")
                 else f"--position-embedding-type {position}")
        out.append(Mismatch(claim, f"model_type {mt}, whose positions are "
                            + ("3-D rotary (mrope: rope_scaling.mrope_section)" if fam.vision else "rotary (rope)")))
    params = text.get("rope_parameters") or {}
    theta_key = "rope_parameters.rope_theta" if params.get("rope_theta") is not None else "rope_theta"
    if "--rotary-base" in given:
        compare("--rotary-base", given["--rotary-base"], theta_key, arch.rotary_base)
    elif whole:
        compare("--rotary-base", 10000, theta_key, arch.rotary_base, claim="no --rotary-base (Megatron-LM's default "
                "10000)")
    # MiniMax-M2 says rotary_dim (arch.py: rotary_dim / head_dim)
    rotary_key, stated = (("rotary_dim / head_dim", "rotary_dim" in text) if fam.model_type == "minimax_m2" else
                          ("partial_rotary_factor", "partial_rotary_factor" in {**text, **params}))
    if "--rotary-percent" in given:
        compare("--rotary-percent", given["--rotary-percent"], rotary_key, arch.rotary_percent,
                truth=None if stated or arch.rotary_percent != 1.0 else
                f"no {rotary_key.split(' ')[0]}: the whole head rotates (1.0)")
    elif whole and arch.rotary_percent != 1.0:
        compare("--rotary-percent", 1.0, rotary_key, arch.rotary_percent,
                claim="no --rotary-percent (Megatron-LM rotates the whole head)")
    pairs = f"model_type {mt}, " + (
        "whose rotary channels rotate in interleaved pairs (x[0::2], x[1::2])" if arch.rotary_interleaved else
        "with multi-latent attention, which interleaves its own way (Megatron-LM refuses --rotary-interleaved with "
        "--multi-latent-attention)" if arch.mla else "which rotates the two halves of each head's rotary channels")
    switch("--rotary-interleaved", arch.rotary_interleaved, pairs, "Megatron-LM rotates the two halves of each head")
    _compare_mla(given, text, arch, whole, out, compare)
    gate = f"model_type {mt}, " + ("whose attention's output is scaled by sigmoid of a gate q_proj computes with "
                                   "each head's query" if arch.attention_output_gate else "without an output gate on "
                                   "attention")
    switch("--attention-output-gate", arch.attention_output_gate, gate, "Megatron-LM builds no output gate")
    switch("--use-gated-attention", arch.attention_output_gate, gate, "", read_absent=False)  # slime's spec reads it
    for flag, what in _NO_FAMILY_HAS.items():
        if flag == "--moe-router-enable-expert-bias" and arch.moe_expert_bias:
            continue
        if has(flag):
            out.append(Mismatch(flag, f"model_type {mt}, which has no {what}"))
    spec = given.get("--spec")
    if fam.slime_vl_spec and spec == list(fam.slime_vl_spec):
        # slime's Qwen3.5 vision-language provider (slime_plugins.models.qwen3_5_vl: geo3k's image prompts): the
        # text decoder with the HF vision tower, trained, as the trainer builds it from a config.json with vision_config
        if arch.vision is None:
            out.append(Mismatch(f"--spec {' '.join(spec)}", f"model_type {mt} without vision_config, "
                                "whose text decoder alone the trainer builds, while that model provider trains the "
                                f"vision tower on image prompts; for text-only prompts give --spec "
                                f"{' '.join(fam.slime_spec)}", other_model=False))
    elif spec is not None and spec not in ([], ["local"]) and (not fam.slime_spec or spec != list(fam.slime_spec)):
        out.append(Mismatch(f"--spec {' '.join(spec)}", f"model_type {mt}, which the trainer builds with "
                            "megatron-core's local layer spec (config/families.py); a spec function is not loaded"))
    # --mtp-num-layers builds the MTP layers (TrainerConfig.mtp_num_layers): preflight checks it against config.json
    # (convert/arch.py with_mtp), whether MODEL_ARGS or the run's own flags give it
    _compare_moe(given, text, arch, whole, out, compare)
    return out


def _compare_mla(given: dict[str, Any], text: dict[str, Any], arch: ModelArch, whole: bool, out: list[Mismatch],
                 compare: Any) -> None:
    """Multi-latent attention's flags against deepseek_v3's config.json (Megatron-LM reads them only with
    --multi-latent-attention): the latent ranks and head widths, and YaRN's factor and mscales."""
    mt = repr(arch.model_type)
    if given.get("--multi-latent-attention") and not arch.mla:
        out.append(Mismatch("--multi-latent-attention", f"model_type {mt}, which has no multi-latent attention "
                            "(no kv_lora_rank)"))
        return
    if not arch.mla:
        return
    if not given.get("--multi-latent-attention"):
        if whole:
            out.append(Mismatch("no --multi-latent-attention (Megatron-LM builds standard attention)",
                                f"kv_lora_rank {arch.kv_lora_rank}: multi-latent attention"))
        return
    q_lora = arch.q_lora_rank or None
    if "--q-lora-rank" in given:
        compare("--q-lora-rank", given["--q-lora-rank"], "q_lora_rank", q_lora or "null",
                truth=None if q_lora else "q_lora_rank null: one query projection")
    elif q_lora and whole:
        out.append(Mismatch("no --q-lora-rank (Megatron-LM builds one query projection)", f"q_lora_rank {q_lora}"))
    for flag, key, actual in (("--kv-lora-rank", "kv_lora_rank", arch.kv_lora_rank),
                              ("--qk-head-dim", "qk_nope_head_dim", arch.qk_nope_head_dim),
                              ("--qk-pos-emb-head-dim", "qk_rope_head_dim", arch.qk_rope_head_dim),
                              ("--v-head-dim", "v_head_dim", arch.v_head_dim)):
        if flag in given:
            compare(flag, given[flag], key, actual)
    scaling = "rope_scaling" if text.get("rope_scaling") else "rope_parameters"
    factor = arch.yarn_factor or 1.0
    if "--rotary-scaling-factor" in given:
        compare("--rotary-scaling-factor", given["--rotary-scaling-factor"], f"{scaling}.factor", factor,
                truth=None if arch.yarn_factor else "no YaRN (default RoPE: factor 1)")
    if arch.yarn_factor:  # the mscales matter only with YaRN (factor 1 makes both 1)
        for flag, key, actual in (("--mscale", "mscale", arch.yarn_mscale),
                                  ("--mscale-all-dim", "mscale_all_dim", arch.yarn_mscale_all_dim)):
            if flag in given:
                compare(flag, given[flag], f"{scaling}.{key}", actual)


def _compare_moe(given: dict[str, Any], text: dict[str, Any], arch: ModelArch, whole: bool, out: list[Mismatch],
                 compare: Any) -> None:
    """The mixture-of-experts flags: Megatron-LM reads them only with --num-experts (a dense model's
    MODEL_ARGS may carry them unread)."""
    fam, mt = arch.family, repr(arch.model_type)
    experts = given.get("--num-experts")
    key = next((k for k in ("num_experts", "n_routed_experts", "num_local_experts") if k in text), "num_experts")
    if experts is not None:
        if arch.num_experts:
            compare("--num-experts", experts, key, arch.num_experts)
        elif experts:
            out.append(Mismatch(f"--num-experts {experts}", f"model_type {mt}, a dense model (no num_experts)"))
    elif whole and arch.num_experts:
        out.append(Mismatch("no --num-experts (Megatron-LM builds dense MLPs)", f"{key} {arch.num_experts}"))
    if not arch.num_experts:
        return
    for flag, cfg_key, actual in (("--moe-router-topk", "num_experts_per_tok", arch.moe_topk),
                                  ("--moe-ffn-hidden-size", fam.moe_ffn_key, arch.moe_ffn_hidden_size)):
        if flag in given:
            compare(flag, given[flag], cfg_key, actual)
    shared = arch.moe_shared_expert_ffn_hidden_size
    deepseek = fam.deepseek_moe
    shared_key = "n_shared_experts x moe_intermediate_size" if deepseek else "shared_expert_intermediate_size"
    no_shared = f"model_type {mt}, without a shared expert (no {shared_key})"
    if "--moe-shared-expert-intermediate-size" in given:
        compare("--moe-shared-expert-intermediate-size", given["--moe-shared-expert-intermediate-size"],
                shared_key, shared, truth=None if shared else no_shared)
    elif whole and shared:
        out.append(Mismatch("no --moe-shared-expert-intermediate-size (Megatron-LM builds no shared expert)",
                            f"{shared_key} {shared}"))
    if given.get("--moe-shared-expert-gate") and not (shared and fam.shared_expert_gate):
        out.append(Mismatch("--moe-shared-expert-gate", no_shared if not shared else
                            f"model_type {mt}, whose shared expert's output is added ungated"))
    elif not given.get("--moe-shared-expert-gate") and whole and shared and fam.shared_expert_gate and \
            "--moe-shared-expert-intermediate-size" in given:
        out.append(Mismatch("no --moe-shared-expert-gate (Megatron-LM adds the shared expert's output ungated)",
                            f"model_type {mt}, whose shared expert is scaled by sigmoid(shared_expert_gate)"))
    if "--moe-layer-freq" in given:
        freq = given["--moe-layer-freq"]
        stated = megatron_moe_layers(freq, given.get("--num-layers", arch.num_layers))
        actual = [int(m) for m in arch.moe_layers]
        if stated != actual:
            dense = text.get("mlp_only_layers") or []
            source = (f"first_k_dense_replace {text.get('first_k_dense_replace', 0)}" if deepseek else
                      f"mlp_only_layers {dense} and decoder_sparse_step {text.get('decoder_sparse_step', 1)}")
            out.append(Mismatch(f"--moe-layer-freq {freq if isinstance(freq, int) else layer_pattern(freq)}"
                                + (f" (MoE layers {layer_pattern(stated)})" if isinstance(freq, int) else ""),
                                f"{source}: MoE layers {layer_pattern(actual)}"))
    if "--moe-router-score-function" in given:
        compare("--moe-router-score-function", given["--moe-router-score-function"], "", arch.moe_score_function,
                truth=f"model_type {mt}, whose router is a {arch.moe_score_function}")
    if arch.moe_expert_bias and not given.get("--moe-router-enable-expert-bias") and whole:
        out.append(Mismatch("no --moe-router-enable-expert-bias (Megatron-LM's router adds no expert bias)",
                            f"model_type {mt}, whose router chooses by score + e_score_correction_bias"))
    # with a sigmoid router megatron reads no --moe-router-pre-softmax (slime's GLM and DeepSeek files give it)
    pre = not arch.moe_norm_topk_prob  # HF's norm_topk_prob false: the top-k of the softmax over all experts
    if arch.moe_score_function == "softmax" and given.get("--moe-router-pre-softmax") and not pre:
        out.append(Mismatch("--moe-router-pre-softmax (the top-k of the softmax over all experts, not renormalised)",
                            "norm_topk_prob true"))
    elif arch.moe_score_function == "softmax" and not given.get("--moe-router-pre-softmax") and whole and pre:
        out.append(Mismatch("no --moe-router-pre-softmax (Megatron-LM's softmax over the top-k logits renormalises "
                            "them)", "norm_topk_prob false"))
    scaling = arch.moe_scaling_factor
    if "--moe-router-topk-scaling-factor" in given:
        compare("--moe-router-topk-scaling-factor", given["--moe-router-topk-scaling-factor"], "routed_scaling_factor",
                1.0 if scaling is None else scaling, truth=None if deepseek else
                f"model_type {mt}, which scales no routing weight (no routed_scaling_factor)")
    elif whole and scaling not in (None, 1.0):
        out.append(Mismatch("no --moe-router-topk-scaling-factor (Megatron-LM scales no routing weight)",
                            f"routed_scaling_factor {fmt(scaling)}"))
    groups = arch.moe_num_groups or 1
    if "--moe-router-num-groups" in given:
        compare("--moe-router-num-groups", given["--moe-router-num-groups"], "n_group", groups,
                truth=None if deepseek else f"model_type {mt}, which routes over all experts at once (no n_group)")
    elif whole and groups > 1:
        out.append(Mismatch("no --moe-router-num-groups (Megatron-LM routes over all experts at once)",
                            f"n_group {groups}"))
    if "--moe-router-group-topk" in given and groups > 1:
        compare("--moe-router-group-topk", given["--moe-router-group-topk"], "topk_group", arch.moe_group_topk)


def model_args_error(given: dict[str, Any], hf: dict[str, Any], arch: ModelArch, checkpoint: str) -> str | None:
    """The sentence that refuses MODEL_ARGS describing another model than --hf-checkpoint's, or None."""
    mismatches = compare_model_args(given, hf, arch)
    if not mismatches:
        return None
    first, *more = mismatches
    return (f"{first.claim}: --hf-checkpoint {checkpoint}'s config.json says {first.truth}"
            + "".join(f"; {m.claim}: it says {m.truth}" for m in more)
            + ("; slime's MODEL_ARGS must describe that checkpoint (is the models/*.sh for another model?)"
               if any(m.other_model for m in mismatches) else ""))
