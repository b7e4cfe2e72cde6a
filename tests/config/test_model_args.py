"""slime's MODEL_ARGS are accepted and compared with --hf-checkpoint's config.json, before anything starts.

The argument lists are slime's scripts/models/*.sh at THUDM/slime 624b824a as bash expands them (the
MoE files build --moe-layer-freq in a loop; the expansion is written out here), copied as facts.
The config.json files are the hub's (tests/orchestration/hf_configs; tests/config/hf_configs for the
families not supported here). What each flag must equal is written here from Megatron-LM's meaning of
the flag (megatron/training/arguments.py, TransformerConfig), not from slime_rl's code: the config.json
key each value flag describes (`KEYS`), which switches state a feature of the model (`SWITCHES`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from slime_rl.config import ConfigError, build_config
from slime_rl.config.families import FAMILIES
from slime_rl.train import check_model_features
from slime_rl.train import main as train_main

HUB = Path(__file__).resolve().parents[1] / "orchestration" / "hf_configs"
UNSUPPORTED = Path(__file__).parent / "hf_configs"
SUPPORTED = ", ".join(sorted(FAMILIES))  # the families config/families.py lists, as the refusal names them
MIGRATION = Path(__file__).parents[1] / "migration" / "hf_configs"

# scripts/models/qwen3-4B.sh (MODEL_ARGS_ROTARY_BASE unset: 1000000)
QWEN3_4B = """--swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32
--group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear
--normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 --kv-channels 128
--qk-layernorm"""
# scripts/models/qwen3-30B-A3B.sh: NLAYERS=48, FIRST_K_DENSE_REPLACE=0, so the loop writes 48 ones joined by commas
QWEN3_30B_A3B = f"""--disable-bias-linear --qk-layernorm --group-query-attention --num-attention-heads 32
--num-query-groups 4 --kv-channels 128 --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144
--normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --rotary-percent 1.0 --swiglu
--untie-embeddings-and-output-weights --vocab-size 151936 --rotary-base 1000000
--moe-ffn-hidden-size 768 --moe-router-score-function softmax --moe-token-dispatcher-type alltoall
--moe-router-topk 8 --moe-layer-freq [{','.join(['1'] * 48)}] --num-experts 128 --moe-grouped-gemm
--moe-token-drop-policy probs --moe-router-dtype fp32 --moe-permute-fusion --moe-aux-loss-coeff 0"""
# scripts/models/qwen2.5-0.5B.sh and qwen2.5-3B.sh
QWEN2_5_0_5B = """--swiglu --num-layers 24 --hidden-size 896 --ffn-hidden-size 4864 --num-attention-heads 14
--use-rotary-position-embeddings --disable-bias-linear --add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-6
--rotary-base 1000000 --group-query-attention --num-query-groups 2 --vocab-size 151936"""
QWEN2_5_3B = """--swiglu --num-layers 36 --hidden-size 2048 --ffn-hidden-size 11008 --num-attention-heads 16
--use-rotary-position-embeddings --disable-bias-linear --add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-6
--rotary-base 1000000 --group-query-attention --num-query-groups 2 --vocab-size 151936"""
# scripts/models/qwen2.5-1.5B.sh: --rotary-base 10000, where Qwen2.5-1.5B's rope_theta is 1000000 (slime's own
# config.json check, _hf_validate_args, compares rope_theta with --rotary-base too)
QWEN2_5_1_5B = """--swiglu --num-layers 28 --hidden-size 1536 --ffn-hidden-size 8960 --num-attention-heads 12
--use-rotary-position-embeddings --disable-bias-linear --add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-6
--rotary-base 10000 --group-query-attention --num-query-groups 2 --vocab-size 151936"""
# scripts/models/deepseek-v3.sh (NLAYERS 61, FIRST_K_DENSE_REPLACE 3) and glm4.5-106B-A12B.sh
DEEPSEEK_V3 = f"""--disable-bias-linear --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432
--num-attention-heads 128 --kv-channels 128 --normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6
--swiglu --untie-embeddings-and-output-weights --vocab-size 129280 --multi-latent-attention --q-lora-rank 1536
--kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm
--rotary-scaling-factor 40 --rotary-base 10000 --mscale 1.0 --mscale-all-dim 1.0 --attention-softmax-in-fp32
--no-rope-fusion --num-experts 256 --moe-layer-freq [{','.join(['0'] * 3 + ['1'] * 58)}] --moe-ffn-hidden-size 2048
--moe-router-topk 8 --moe-shared-expert-intermediate-size 2048 --moe-router-pre-softmax
--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-load-balancing-type seq_aux_loss
--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0 --moe-router-bias-update-rate 0 --moe-router-group-topk 4
--moe-router-num-groups 8 --moe-grouped-gemm --moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32
--moe-permute-fusion"""
# scripts/models/qwen3-next-80B-A3B.sh (slime's own spec, gated attention and linear attention layers)
QWEN3_NEXT = f"""--spec slime_plugins.models.qwen3_next get_qwen3_next_spec --disable-bias-linear --qk-layernorm
--group-query-attention --num-attention-heads 16 --num-query-groups 2 --kv-channels 256 --num-layers 48
--hidden-size 2048 --ffn-hidden-size 5120 --use-gated-attention --normalization RMSNorm --apply-layernorm-1p
--position-embedding-type rope --norm-epsilon 1e-6 --rotary-percent 0.25 --swiglu
--untie-embeddings-and-output-weights --vocab-size 151936
--rotary-base 10000000 --moe-ffn-hidden-size 512 --moe-shared-expert-intermediate-size 512
--moe-router-score-function softmax --moe-token-dispatcher-type alltoall --moe-router-topk 10
--moe-layer-freq [{','.join(['1'] * 48)}] --num-experts 512 --moe-grouped-gemm --moe-token-drop-policy probs
--moe-router-dtype fp32 --moe-permute-fusion --moe-aux-loss-coeff 0 --attention-output-gate --moe-shared-expert-gate"""
GLM4_5_AIR = """--disable-bias-linear --group-query-attention --num-attention-heads 96 --num-query-groups 8
--kv-channels 128 --num-layers 46 --hidden-size 4096 --ffn-hidden-size 10944 --add-qkv-bias --normalization RMSNorm
--position-embedding-type rope --rotary-percent 0.5 --swiglu --untie-embeddings-and-output-weights
--vocab-size 151552 --rotary-base 1000000 --moe-ffn-hidden-size 1408 --moe-shared-expert-intermediate-size 1408
--moe-router-pre-softmax --moe-router-score-function sigmoid --moe-router-enable-expert-bias
--moe-router-bias-update-rate 0 --moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall
--moe-router-topk 8 --moe-layer-freq [0]*1+[1]*45 --num-experts 128 --moe-grouped-gemm --moe-router-dtype fp32
--moe-permute-fusion --moe-aux-loss-coeff 0"""
# scripts/models/glm4-9B.sh (GLM-4-9B-0414 / GLM-Z1-9B-0414), with the spec function slime's run-glm4-9B.sh gives
GLM4_9B = """--spec slime_plugins.models.glm4 get_glm_spec --swiglu --num-layers 40 --hidden-size 4096
--ffn-hidden-size 13696 --num-attention-heads 32 --group-query-attention --num-query-groups 2
--use-rotary-position-embeddings --disable-bias-linear --add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-5
--rotary-base 10000 --vocab-size 151552 --post-self-attn-layernorm --post-mlp-layernorm --rotary-interleaved
--rotary-percent 0.5 --no-rope-fusion --untie-embeddings-and-output-weights"""
# scripts/models/minimax-m2.sh (MiniMax-M2.5), with its spec function
MINIMAX_M2 = """--spec slime_plugins.models.minimax_m2 get_minimax_m2_layer_spec --disable-bias-linear --num-layers 62
--hidden-size 3072 --ffn-hidden-size 1536 --num-attention-heads 48 --kv-channels 128 --num-query-groups 8
--normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --swiglu
--untie-embeddings-and-output-weights --vocab-size 200064 --group-query-attention --rotary-percent 0.5
--rotary-base 5000000 --qk-layernorm --no-rope-fusion --attention-softmax-in-fp32 --num-experts 256
--moe-ffn-hidden-size 1536 --moe-router-topk 8 --moe-layer-freq [1]*62 --moe-router-pre-softmax
--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-load-balancing-type none
--moe-token-dispatcher-type alltoall --moe-router-dtype fp32 --moe-aux-loss-coeff 0 --moe-grouped-gemm
--moe-permute-fusion"""

SCRIPTS = {"qwen3-4B": (QWEN3_4B, "qwen3_4b.json"), "qwen3-30B-A3B": (QWEN3_30B_A3B, "qwen3_30b_a3b.json"),
           "qwen2.5-0.5B": (QWEN2_5_0_5B, "qwen2_5_0_5b.json"), "qwen2.5-3B": (QWEN2_5_3B, "qwen2_5_3b.json")}

# Megatron-LM's meaning of each value flag, as the config.json key it describes
KEYS = {"--num-layers": "num_hidden_layers", "--hidden-size": "hidden_size", "--ffn-hidden-size": "intermediate_size",
        "--num-attention-heads": "num_attention_heads", "--num-query-groups": "num_key_value_heads",
        "--kv-channels": "head_dim", "--norm-epsilon": "rms_norm_eps", "--rotary-base": "rope_theta",
        "--vocab-size": "vocab_size", "--num-experts": "num_experts", "--moe-router-topk": "num_experts_per_tok",
        "--moe-ffn-hidden-size": "moe_intermediate_size"}


def _checkpoint(tmp: Path, config: str, folder: Path = HUB) -> Path:
    """An HF folder holding only config.json (no weights: preflight reads only the config)."""
    hf = tmp / config.removesuffix(".json")
    hf.mkdir(exist_ok=True)
    shutil.copy(folder / config, hf / "config.json")
    return hf


def _base(tmp: Path, hf: Path) -> list[str]:
    (tmp / "d.jsonl").write_text('{"input": "1", "label": "1"}\n')
    return ["--hf-checkpoint", str(hf), "--prompt-data", str(tmp / "d.jsonl"), "--rollout-batch-size", "4",
            "--num-rollout", "1", "--rm-type", "digit"]


def _check(tmp: Path, config: str, tokens: list[str], folder: Path = HUB):
    cfg = build_config(_base(tmp, _checkpoint(tmp, config, folder)) + tokens)
    check_model_features(cfg)
    return cfg


def _refused(tmp: Path, config: str, tokens: list[str], folder: Path = HUB) -> str:
    with pytest.raises(ConfigError) as info:
        _check(tmp, config, tokens, folder)
    return str(info.value)


def _show(value) -> str:
    """A number as config.json means it (1000000.0 is the integer 1000000)."""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _replace(tokens: list[str], flag: str, value: str) -> list[str]:
    i = tokens.index(flag)
    return tokens[:i + 1] + [value] + tokens[i + 2:]


def _without(tokens: list[str], flag: str) -> list[str]:
    i = tokens.index(flag)
    takes_value = i + 1 < len(tokens) and not tokens[i + 1].startswith("--")
    return tokens[:i] + tokens[i + 1 + takes_value:]


@pytest.mark.parametrize("name", SCRIPTS)
def test_slimes_model_args_describe_their_checkpoints(name, tmp_path):
    text, config = SCRIPTS[name]
    cfg = _check(tmp_path, config, text.split())
    kept = cfg.model.megatron_model_args
    # every MODEL_ARGS flag kept as given, under its name (the trainer section's own MoE flags aside)
    assert set(kept) == {t for t in text.split() if t.startswith("--")} - {
        "--moe-token-dispatcher-type", "--moe-aux-loss-coeff", "--moe-grouped-gemm"}
    assert kept["--num-layers"] == json.loads((HUB / config).read_text())["num_hidden_layers"]


def _value_cases() -> list[tuple[str, str]]:
    cases = []
    for name, (text, _) in SCRIPTS.items():
        for flag in KEYS:
            if flag in text.split():
                cases.append((name, flag))
    return cases


@pytest.mark.parametrize("name, flag", _value_cases(), ids=[f"{n}{f}" for n, f in _value_cases()])
def test_each_value_changed_by_one_is_refused_naming_the_flag_both_values_and_the_key(name, flag, tmp_path):
    text, config = SCRIPTS[name]
    tokens = text.split()
    hf_cfg = json.loads((HUB / config).read_text())
    key = KEYS[flag]
    if flag == "--ffn-hidden-size" and hf_cfg.get("num_experts"):
        # every layer of Qwen3-30B-A3B is an MoE layer: Megatron-LM builds no dense MLP, the width sizes nothing
        _check(tmp_path, config, _replace(tokens, flag, "6145"))
        return
    old = tokens[tokens.index(flag) + 1]
    new = "1e-5" if flag == "--norm-epsilon" else str(int(old) + 1)
    message = _refused(tmp_path, config, _replace(tokens, flag, new))
    shown = {"1e-5": "1e-05"}.get(new, new)
    assert message.startswith(f"{flag} {shown}: --hf-checkpoint {tmp_path / config.removesuffix('.json')}'s "
                              f"config.json says {key} {_show(hf_cfg[key])}"), message
    assert message.endswith("slime's MODEL_ARGS must describe that checkpoint (is the models/*.sh for another "
                            "model?)"), message


@pytest.mark.parametrize("flag, value, truth", [
    ("--normalization", "LayerNorm", "model_type 'qwen3_moe', whose norms are RMSNorm"),
    ("--position-embedding-type", "learned_absolute", "model_type 'qwen3_moe', whose positions are rotary (rope)"),
    ("--moe-router-score-function", "sigmoid", "model_type 'qwen3_moe', whose router is a softmax"),
    ("--rotary-percent", "0.5", "no partial_rotary_factor: the whole head rotates (1.0)"),
])
def test_each_choice_changed_is_refused_naming_what_the_family_has(flag, value, truth, tmp_path):
    message = _refused(tmp_path, "qwen3_30b_a3b.json", _replace(QWEN3_30B_A3B.split(), flag, value))
    assert message.startswith(f"{flag} {value}: --hf-checkpoint ") and f"config.json says {truth};" in message, message


# switches whose absence Megatron-LM reads as the opposite feature, with the config.json key that decides it,
# and the scripts that give them: left out of a whole MODEL_ARGS, the model Megatron-LM builds differs
ABSENCE_STATES = {"--qk-layernorm": ("qwen3-4B", "q_norm"), "--add-qkv-bias": ("qwen2.5-0.5B", "q/k/v"),
                  "--untie-embeddings-and-output-weights": ("qwen3-30B-A3B", "tie_word_embeddings false"),
                  "--group-query-attention": ("qwen2.5-3B", "num_key_value_heads 2")}
# switches every slime model file gives; left out they are not compared (docs/flags.md says so)
ALWAYS_GIVEN = ("--swiglu", "--disable-bias-linear", "--use-rotary-position-embeddings")


@pytest.mark.parametrize("flag", ABSENCE_STATES)
def test_a_switch_left_out_of_a_whole_model_args_is_compared(flag, tmp_path):
    name, truth = ABSENCE_STATES[flag]
    text, config = SCRIPTS[name]
    message = _refused(tmp_path, config, _without(text.split(), flag))
    assert message.startswith(f"no {flag} (") and truth in message, message


@pytest.mark.parametrize("flag", ALWAYS_GIVEN)
def test_a_switch_every_model_file_gives_is_compared_only_when_given(flag, tmp_path):
    _check(tmp_path, "qwen2_5_0_5b.json", _without(QWEN2_5_0_5B.split(), flag))


@pytest.mark.parametrize("name, flag, truth", [
    ("qwen3-4B", "--untie-embeddings-and-output-weights", "tie_word_embeddings true"),
    ("qwen2.5-3B", "--untie-embeddings-and-output-weights", "tie_word_embeddings true"),
    ("qwen3-4B", "--add-qkv-bias", "attention_bias false"),
    ("qwen2.5-0.5B", "--qk-layernorm", "without q/k norm"),
    ("qwen3-30B-A3B", "--moe-router-pre-softmax", "norm_topk_prob true"),
    ("qwen3-30B-A3B", "--moe-shared-expert-gate", "without a shared expert"),
    ("qwen3-4B", "--multi-latent-attention", "no multi-latent attention"),
    ("qwen3-4B", "--apply-layernorm-1p", "model_type 'qwen3', whose RMSNorms scale by w"),
    ("qwen3-4B", "--attention-output-gate", "without an output gate on attention"),
    ("qwen3-4B", "--use-gated-attention", "without an output gate on attention"),
    ("qwen3-4B", "--rotary-interleaved", "which rotates the two halves of each head's rotary channels"),
    ("qwen3-4B", "--post-self-attn-layernorm", "without norms after attention and the MLP"),
    ("qwen2.5-0.5B", "--post-mlp-layernorm", "without norms after attention and the MLP"),
    ("qwen3-4B", "--use-rope-scaling", "RoPE scaling"),
    ("qwen3-30B-A3B", "--moe-router-enable-expert-bias", "expert bias"),
])
def test_a_switch_the_model_lacks_is_refused(name, flag, truth, tmp_path):
    text, config = SCRIPTS[name]
    message = _refused(tmp_path, config, text.split() + [flag])
    assert message.startswith(flag) and truth in message, message


@pytest.mark.parametrize("flag, default, key, value", [
    ("--norm-epsilon", "1e-05", "rms_norm_eps", "1e-06"),  # Megatron-LM's default 1e-5
    ("--rotary-base", "10000", "rope_theta", "1000000"),  # Megatron-LM's default 10000
    ("--kv-channels", "80", "head_dim", "128"),  # Megatron-LM: hidden_size // num_attention_heads = 2560 // 32
])
def test_a_value_flag_left_out_is_megatrons_default(flag, default, key, value, tmp_path):
    message = _refused(tmp_path, "qwen3_4b.json", _without(QWEN3_4B.split(), flag))
    assert message.startswith(f"no {flag} (") and default in message.split(":")[0], message
    assert f"config.json says {key} {value}" in message, message


def test_group_query_attention_without_its_group_count_is_megatrons_one_group(tmp_path):
    message = _refused(tmp_path, "qwen2_5_0_5b.json", _without(QWEN2_5_0_5B.split(), "--num-query-groups"))
    assert "--group-query-attention without --num-query-groups" in message and "num_key_value_heads 2" in message


def test_a_partial_model_args_compares_only_what_it_gives(tmp_path):
    """Without --num-layers / --hidden-size / --num-attention-heads Megatron-LM could not build a model: the
    flags given are statements about the checkpoint, the ones left out are not."""
    _check(tmp_path, "qwen3_4b.json", ["--num-layers", "36", "--vocab-size", "151936"])
    assert "--vocab-size 151937" in _refused(tmp_path, "qwen3_4b.json", ["--vocab-size", "151937"])


@pytest.mark.parametrize("freq, accepted", [
    ("1", True),  # Megatron-LM: layer i is an MoE layer when i % 1 == 0, every layer
    ("[1]*48", True), ("([1]*48)", True), ("([1]*24)*2", True),
    ("([0]*1+[1]*47)", False),  # layer 0 dense: Qwen3-30B-A3B has mlp_only_layers []
    ("2", False),  # every other layer
    ("[1]*47", False),  # a pattern of 47 layers for 48
])
def test_moe_layer_freq_is_read_as_megatron_reads_it(freq, accepted, tmp_path):
    tokens = _replace(QWEN3_30B_A3B.split(), "--moe-layer-freq", freq)
    if accepted:
        _check(tmp_path, "qwen3_30b_a3b.json", tokens)
    else:
        message = _refused(tmp_path, "qwen3_30b_a3b.json", tokens)
        assert message.startswith("--moe-layer-freq ") and "mlp_only_layers [] and decoder_sparse_step 1: MoE " \
            "layers [1]*48" in message, message


@pytest.mark.parametrize("freq", ["[1, 1]", "abc", "[1]*x", "__import__('os')"])
def test_a_moe_layer_freq_that_is_no_list_of_layers_is_refused_at_parse(freq, tmp_path):
    with pytest.raises(ConfigError, match="--moe-layer-freq"):
        build_config(_base(tmp_path, _checkpoint(tmp_path, "qwen3_30b_a3b.json")) + ["--moe-layer-freq", freq])


def test_slimes_qwen2_5_1_5b_file_is_refused_for_its_rotary_base(tmp_path):
    """slime's qwen2.5-1.5B.sh says --rotary-base 10000; the Qwen2.5-1.5B checkpoints say rope_theta 1000000."""
    message = _refused(tmp_path, "qwen2_5_1_5b_instruct.json", QWEN2_5_1_5B.split())
    assert message.startswith("--rotary-base 10000: ") and "says rope_theta 1000000;" in message, message


def test_a_model_file_for_another_model_names_every_difference(tmp_path):
    message = _refused(tmp_path, "qwen3_4b.json", QWEN3_30B_A3B.split())
    for part in ("--num-layers 48: --hf-checkpoint", "num_hidden_layers 36", "--hidden-size 2048: it says hidden_size "
                 "2560", "--untie-embeddings-and-output-weights: it says tie_word_embeddings true",
                 "--num-experts 128: it says model_type 'qwen3', a dense model"):
        assert part in message, (part, message)


# a MODEL_ARGS for Qwen1.5-MoE-A2.7B (qwen2_moe: a shared expert with a sigmoid gate, norm_topk_prob false, no
# GQA), written from Megatron-LM's meaning of each flag; slime has no model file for it
QWEN1_5_MOE = """--swiglu --num-layers 24 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16
--disable-bias-linear --add-qkv-bias --normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000
--vocab-size 151936 --untie-embeddings-and-output-weights --position-embedding-type rope --num-experts 60
--moe-router-topk 4 --moe-ffn-hidden-size 1408 --moe-shared-expert-intermediate-size 5632 --moe-shared-expert-gate
--moe-router-pre-softmax --moe-router-score-function softmax --moe-layer-freq 1"""


def test_a_shared_expert_model(tmp_path):
    config = "qwen1_5_moe_a2_7b.json"
    _check(tmp_path, config, QWEN1_5_MOE.split())
    tokens = QWEN1_5_MOE.split()
    assert "norm_topk_prob false" in _refused(tmp_path, config, _without(tokens, "--moe-router-pre-softmax"))
    assert "sigmoid(shared_expert_gate)" in _refused(tmp_path, config, _without(tokens, "--moe-shared-expert-gate"))
    message = _refused(tmp_path, config, _replace(tokens, "--moe-shared-expert-intermediate-size", "5633"))
    assert "--moe-shared-expert-intermediate-size 5633: " in message and "shared_expert_intermediate_size 5632" in \
        message
    message = _refused(tmp_path, config, tokens + ["--group-query-attention", "--num-query-groups", "4"])
    assert "--num-query-groups 4: " in message and "num_key_value_heads 16" in message


NO_EFFECT = """--moe-permute-fusion --moe-token-drop-policy position --no-rope-fusion
--no-masked-softmax-fusion --enable-experimental --seq-length 32768 --make-vocab-size-divisible-by 64 --mscale 1.0
--mscale-all-dim 1.0 --rotary-scaling-factor 40 --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128
--qk-pos-emb-head-dim 64 --v-head-dim 128 --moe-router-group-topk 4 --moe-router-bias-update-rate 0"""


def test_flags_without_shape_meaning_are_accepted_and_kept(tmp_path):
    cfg = _check(tmp_path, "qwen3_30b_a3b.json", QWEN3_30B_A3B.split() + NO_EFFECT.split())
    kept = cfg.model.megatron_model_args
    assert kept["--seq-length"] == 32768 and kept["--moe-token-drop-policy"] == "position"
    assert kept["--rotary-scaling-factor"] == 40.0


def test_the_router_dtype_is_fp32_only(tmp_path):
    with pytest.raises(ConfigError, match="--moe-router-dtype must be fp32: the routers compute in fp32"):
        build_config(_base(tmp_path, _checkpoint(tmp_path, "qwen3_30b_a3b.json")) + ["--moe-router-dtype", "fp64"])


def test_spec_local_only(tmp_path):
    _check(tmp_path, "qwen3_4b.json", QWEN3_4B.split() + ["--spec", "local"])
    message = _refused(tmp_path, "qwen3_4b.json", QWEN3_4B.split() + ["--spec", "slime_plugins.models.glm4",
                                                                        "get_glm_spec"])
    assert message.startswith("--spec slime_plugins.models.glm4 get_glm_spec: ") and "local layer spec" in message


def test_every_flag_of_slimes_model_files_is_read(tmp_path):
    """The 66 flags of slime's 39 scripts/models/*.sh, each with a value one of those files gives it: the parser
    knows them all (a run then compares, accepts or refuses each with its reason)."""
    from slime_rl.config import parse_flags

    flags = """--add-qkv-bias --allgather-cp --apply-layernorm-1p --attention-output-gate --attention-softmax-in-fp32
    --disable-bias-linear --enable-experimental --ffn-hidden-size 18432 --group-query-attention --hidden-size 7168
    --kv-channels 128 --kv-lora-rank 512 --make-vocab-size-divisible-by 64 --max-position-embeddings 32768
    --moe-aux-loss-coeff 0 --moe-ffn-hidden-size 2048 --moe-grouped-gemm --moe-layer-freq [0,0,0,1,1]
    --moe-permute-fusion --moe-router-bias-update-rate 0 --moe-router-dtype fp32 --moe-router-enable-expert-bias
    --moe-router-group-topk 4 --moe-router-load-balancing-type seq_aux_loss --moe-router-num-groups 8
    --moe-router-pre-softmax --moe-router-score-function sigmoid --moe-router-topk 8
    --moe-router-topk-scaling-factor 2.5 --moe-shared-expert-gate --moe-shared-expert-intermediate-size 2048
    --moe-token-dispatcher-type alltoall --moe-token-drop-policy probs --mscale 1.0 --mscale-all-dim 1.0
    --mtp-num-layers 1 --multi-latent-attention --no-masked-softmax-fusion --no-position-embedding --no-rope-fusion
    --norm-epsilon 1e-6 --normalization RMSNorm --num-attention-heads 128 --num-experts 256 --num-layers 5
    --num-query-groups 8 --position-embedding-type rope --post-mlp-layernorm --post-self-attn-layernorm
    --q-lora-rank 1536 --qk-head-dim 128 --qk-layernorm --qk-pos-emb-head-dim 64 --rotary-base 10000
    --rotary-interleaved --rotary-percent 0.5 --rotary-scaling-factor 40 --seq-length 32768
    --spec slime_plugins.models.glm4 get_glm_spec --swiglu --untie-embeddings-and-output-weights
    --use-gated-attention --use-rope-scaling --use-rotary-position-embeddings --v-head-dim 128 --vocab-size 129280"""
    tokens = flags.split()
    assert len([t for t in tokens if t.startswith("--")]) == 66
    args, _ = parse_flags(_base(tmp_path, _checkpoint(tmp_path, "qwen3_4b.json")) + tokens)
    assert args.spec == ["slime_plugins.models.glm4", "get_glm_spec"] and args.moe_layer_freq == [0, 0, 0, 1, 1]


# ---- model families this trainer does not build: one sentence naming model_type, before any other check
# (every family of slime's scripts is built now: DeepSeek-V3.2-Exp's model_type, deepseek_v32, on DeepSeek-R1's sizes)
@pytest.mark.parametrize("model, model_type", [("DeepSeek-R1", "deepseek_v32")])
@pytest.mark.parametrize("extra", [[], ["--actor-num-nodes", "2", "--actor-num-gpus-per-node", "8",
                                        "--expert-model-parallel-size", "16", "--rollout-batch-size", "16"]],
                         ids=["no-EP", "EP16"])
def test_an_unsupported_family_is_refused_naming_its_model_type(model, model_type, extra, tmp_path):
    (tmp_path / "hub").mkdir()
    cfg = json.loads((MIGRATION / model / "config.json").read_text())
    (tmp_path / "hub" / f"{model_type}.json").write_text(json.dumps({**cfg, "model_type": model_type}))
    message = _refused(tmp_path, f"{model_type}.json", extra, tmp_path / "hub")
    assert f"its config.json names model_type '{model_type}', which is not a model family this trainer builds " \
           f"(supported: {SUPPORTED})" in message, message
    assert "qwen3_next" in SUPPORTED and "qwen3_5" in SUPPORTED and "qwen3_5_moe" in SUPPORTED
    assert message.endswith(f"(supported: {SUPPORTED})"), message  # no reason: not near a built family (NOT_BUILT)


def test_qwen3_next_model_file_agrees_and_plans(tmp_path, capsys):
    """slime's scripts/models/qwen3-next-80B-A3B.sh (its own spec, --attention-output-gate, --use-gated-attention,
    --apply-layernorm-1p, --rotary-percent 0.25, --kv-channels 256, the gated shared expert) against Qwen3-Next's
    published config.json: every flag agrees, and the dry run plans it on 4 x 8 GPUs with EP 8; the built-in
    engine, which does not serve its Gated DeltaNet layers, is refused in one sentence."""
    hf = _checkpoint(tmp_path, "qwen3_next.json", UNSUPPORTED)
    argv = ["--hf-checkpoint", str(hf), "--prompt-data", "/data/not-here.jsonl", "--rollout-batch-size", "16",
            "--num-rollout", "1", "--rm-type", "math", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "8",
            "--expert-model-parallel-size", "8", "--rollout-num-gpus", "16", "--dry-run", "--cluster", "4x8",
            *QWEN3_NEXT.split()]
    rc, captured = train_main([*argv, "--rollout-backend", "sglang"]), capsys.readouterr()
    assert rc == 0, captured.err
    assert "qwen3_next" in captured.out and "512 experts, top-10, in 48 layers" in captured.out, captured.out
    assert train_main([*argv, "--rollout-backend", "embedded"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"slime-rl train: error: --rollout-backend embedded: --hf-checkpoint {hf} is model_type "
                   "'qwen3_next', whose Gated DeltaNet (linear attention) layers the built-in engine does not serve; "
                   "use --rollout-backend sglang"), err


# scripts/models/qwen3.5-27B.sh (slime's own spec, gated attention and linear attention layers, a dense MLP)
QWEN3_5_27B = """--spec slime_plugins.models.qwen3_5 get_qwen3_5_spec --disable-bias-linear --qk-layernorm
--group-query-attention --num-attention-heads 24 --num-query-groups 4 --kv-channels 256 --num-layers 64
--hidden-size 5120 --ffn-hidden-size 17408 --use-gated-attention --normalization RMSNorm --apply-layernorm-1p
--position-embedding-type rope --norm-epsilon 1e-6 --rotary-percent 0.25 --swiglu
--untie-embeddings-and-output-weights --vocab-size 248320 --rotary-base 10000000 --attention-output-gate"""


def test_qwen3_5_model_file_agrees_and_plans(tmp_path, capsys):
    """slime's scripts/models/qwen3.5-27B.sh against Qwen3.5-27B's config.json (the decoder's fields in text_config):
    every flag agrees and the dry run plans it on 4 x 8 GPUs at TP 4; a flag that differs (--ffn-hidden-size, no
    --apply-layernorm-1p) is named against text_config's value; the built-in engine is refused in one sentence."""
    hf = _checkpoint(tmp_path, "config.json", MIGRATION / "Qwen3.5-27B")
    argv = ["--hf-checkpoint", str(hf), "--prompt-data", "/data/not-here.jsonl", "--rollout-batch-size", "16",
            "--num-rollout", "1", "--rm-type", "math", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "8",
            "--tensor-model-parallel-size", "4", "--rollout-num-gpus", "16", "--dry-run", "--cluster", "4x8",
            *QWEN3_5_27B.split()]
    rc, captured = train_main([*argv, "--rollout-backend", "sglang"]), capsys.readouterr()
    assert rc == 0, captured.err
    assert "qwen3_5" in captured.out, captured.out
    assert train_main([*argv, "--rollout-backend", "embedded"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"slime-rl train: error: --rollout-backend embedded: --hf-checkpoint {hf} is model_type "
                   "'qwen3_5', whose Gated DeltaNet (linear attention) layers the built-in engine does not serve; "
                   "use --rollout-backend sglang"), err
    tokens = QWEN3_5_27B.split() + ["--rollout-backend", "sglang"]
    for changed, claim, truth in ((_replace(tokens, "--ffn-hidden-size", "12288"), "--ffn-hidden-size 12288",
                                   "intermediate_size 17408"),
                                  ([t for t in tokens if t != "--apply-layernorm-1p"],
                                   "no --apply-layernorm-1p (Megatron-LM's norms scale by w)",
                                   "model_type 'qwen3_5', whose RMSNorms store w and scale by 1 + w")):
        message = _refused(tmp_path, "config.json", changed, MIGRATION / "Qwen3.5-27B")
        assert f"{claim}: " in message and truth in message, message


# scripts/models/qwen3.5-35B-A3B.sh (slime's qwen3_5 spec, gated and linear attention, an MoE block with a gated
# shared expert in each of the 40 layers; --ffn-hidden-size one expert's width, as config.json has no dense width)
QWEN3_5_35B_A3B = """--spec slime_plugins.models.qwen3_5 get_qwen3_5_spec --disable-bias-linear --qk-layernorm
--group-query-attention --num-attention-heads 16 --num-query-groups 2 --kv-channels 256 --num-layers 40
--hidden-size 2048 --ffn-hidden-size 512 --use-gated-attention --normalization RMSNorm --apply-layernorm-1p
--position-embedding-type rope --norm-epsilon 1e-6 --rotary-percent 0.25 --swiglu --untie-embeddings-and-output-weights
--vocab-size 248320 --rotary-base 10000000 --moe-ffn-hidden-size 512 --moe-shared-expert-intermediate-size 512
--moe-router-score-function softmax --moe-token-dispatcher-type alltoall --moe-router-topk 8 --moe-layer-freq
[""" + ",".join(["1"] * 40) + """] --num-experts 256 --moe-grouped-gemm --moe-router-dtype fp32 --moe-aux-loss-coeff 0
--attention-output-gate --moe-shared-expert-gate"""


def test_qwen3_5_moe_model_file_agrees_and_plans(tmp_path, capsys):
    """slime's scripts/models/qwen3.5-35B-A3B.sh against Qwen3.5-35B-A3B's config.json (text_config, no
    intermediate_size, the vision tower's vision_config): every flag agrees and the dry run plans it on 2 x 8 GPUs with
    EP 8, the 34.661 B of the text decoder plus the 0.447 B of the vision tower; a flag that differs
    (--moe-router-topk, --num-experts) is named against text_config's value; slime's vision-language provider
    (slime_plugins.models.qwen3_5_vl, geo3k's) is the model the trainer builds, while for a config.json without
    vision_config (the text decoder alone) it is refused in one sentence saying so."""
    hf = _checkpoint(tmp_path, "config.json", MIGRATION / "Qwen3.5-35B-A3B")
    argv = ["--hf-checkpoint", str(hf), "--prompt-data", "/data/not-here.jsonl", "--rollout-batch-size", "16",
            "--num-rollout", "1", "--rm-type", "math", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "8",
            "--expert-model-parallel-size", "8", "--rollout-num-gpus", "16", "--dry-run", "--cluster", "4x8",
            "--rollout-backend", "sglang"]
    rc, captured = train_main(argv + QWEN3_5_35B_A3B.split()), capsys.readouterr()
    assert rc == 0, captured.err
    assert "qwen3_5_moe, 35.107 B parameters" in captured.out, captured.out
    tokens = QWEN3_5_35B_A3B.split() + ["--rollout-backend", "sglang"]
    for changed, claim, truth in ((_replace(tokens, "--moe-router-topk", "4"), "--moe-router-topk 4",
                                   "num_experts_per_tok 8"),
                                  (_replace(tokens, "--num-experts", "128"), "--num-experts 128", "num_experts 256")):
        message = _refused(tmp_path, "config.json", changed, MIGRATION / "Qwen3.5-35B-A3B")
        assert f"{claim}: " in message and truth in message, message
    vl = _replace(_replace(tokens, "--spec", "slime_plugins.models.qwen3_5_vl"), "slime_plugins.models.qwen3_5_vl",
                  "get_qwen3_5_vl_model_provider")
    rc, captured = train_main(argv + vl[:-2]), capsys.readouterr()
    assert rc == 0 and "qwen3_5_moe, 35.107 B parameters" in captured.out, captured.err
    message = _refused(tmp_path, "config.json", vl, MIGRATION / "Qwen3.6-35B-A3B")  # no vision_config in this file
    assert message.startswith("--spec slime_plugins.models.qwen3_5_vl get_qwen3_5_vl_model_provider: "), message
    assert message.endswith("'s config.json says model_type 'qwen3_5_moe' without vision_config, whose text "
                            "decoder alone the trainer builds, while that model provider trains the vision tower "
                            "on image prompts; for text-only prompts give --spec slime_plugins.models.qwen3_5 "
                            "get_qwen3_5_spec"), message


@pytest.mark.parametrize("change, claim, truth", [
    (("--apply-layernorm-1p", None), "no --apply-layernorm-1p (Megatron-LM's norms scale by w)",
     "model_type 'qwen3_next', whose RMSNorms store w and scale by 1 + w"),
    (("--attention-output-gate", None), "no --attention-output-gate (Megatron-LM builds no output gate)",
     "whose attention's output is scaled by sigmoid of a gate"),
    (("--rotary-percent", "0.5"), "--rotary-percent 0.5", "partial_rotary_factor 0.25"),
    (("--kv-channels", "128"), "--kv-channels 128", "head_dim 256"),
    (("--moe-shared-expert-gate", None), "no --moe-shared-expert-gate (Megatron-LM adds the shared expert's output "
     "ungated)",
     "whose shared expert is scaled by sigmoid(shared_expert_gate)"),
])
def test_qwen3_next_model_file_that_differs_is_named(change, claim, truth, tmp_path):
    """Each Qwen3-Next flag compared with what config.json (and the family) says: zero-centred norms, the attention's
    output gate, partial_rotary_factor 0.25, head_dim 256, the shared expert's sigmoid gate; slime's own file as
    written passes the same check, and --apply-layernorm-1p on a family without zero-centred norms is named; LoRA,
    not built for its Gated DeltaNet layers, is refused in one sentence, as is a TP x CP that splits its key heads."""
    tokens = QWEN3_NEXT.split() + ["--rollout-backend", "sglang"]  # the built-in engine does not serve it
    _check(tmp_path, "qwen3_next.json", tokens, UNSUPPORTED)
    flag, value = change
    if value is None:  # leave the switch out
        tokens = [t for t in tokens if t != flag]
    else:
        tokens = _replace(tokens, flag, value)
    message = _refused(tmp_path, "qwen3_next.json", tokens, UNSUPPORTED)
    assert f"{claim}: " in message and truth in message, message
    lora = _refused(tmp_path, "qwen3_next.json", QWEN3_NEXT.split() + ["--rollout-backend", "sglang", "--lora-rank",
                                                                         "8"], UNSUPPORTED)
    assert lora == ("--lora-rank: LoRA on Gated DeltaNet (linear attention) models (qwen3_next) is not built yet; "
                    "train it whole (drop the --lora-* flags)"), lora
    heads = _refused(tmp_path, "qwen3_next.json", QWEN3_NEXT.split() + [
        "--rollout-backend", "sglang", "--context-parallel-size", "32", "--actor-num-gpus-per-node", "32"], UNSUPPORTED)
    assert heads.startswith("--tensor-model-parallel-size 1 x --context-parallel-size 32 = 32 must divide "
                            "linear_num_key_heads 16 of "), heads
    message = _refused(tmp_path, "glm4_5_air.json", GLM4_5_AIR.split() + ["--apply-layernorm-1p"], UNSUPPORTED)
    assert "--apply-layernorm-1p: " in message and "whose RMSNorms scale by w" in message, message


def test_glm4_5_air_model_file_agrees_and_plans(tmp_path, capsys):
    """slime's scripts/models/glm4.5-106B-A12B.sh against GLM-4.5-Air's published config.json: every flag
    agrees (sigmoid router with the expert bias, --rotary-percent 0.5, the dense first layer, the shared
    expert's width, no q/k norm) and the dry run plans it on 2 x 8 GPUs with EP 8, with a note that its MTP
    layer is not trained."""
    hf = _checkpoint(tmp_path, "glm4_5_air.json", UNSUPPORTED)
    argv = ["--hf-checkpoint", str(hf), "--prompt-data", "/data/not-here.jsonl", "--rollout-batch-size", "16",
            "--num-rollout", "1", "--rm-type", "math", "--rollout-backend", "sglang", "--actor-num-nodes", "1",
            "--actor-num-gpus-per-node", "8", "--expert-model-parallel-size", "8", "--rollout-num-gpus", "8",
            "--dry-run", "--cluster", "2x8", *GLM4_5_AIR.split()]
    rc, captured = train_main(argv), capsys.readouterr()
    assert rc == 0, captured.err
    # 46 layers less first_k_dense_replace 1 dense: 45 MoE layers of n_routed_experts 128, top num_experts_per_tok 8
    assert "glm4_moe" in captured.out and "128 experts, top-8, in 45 layers" in captured.out, captured.out
    # num_nextn_predict_layers 1: the MTP layer after the 46 decoder layers is named as not trained
    assert "note: --hf-checkpoint" in captured.err and "1 multi-token-prediction layer(s)" in captured.err
    assert "model.layers.46.*" in captured.err, captured.err


@pytest.mark.parametrize("change, claim, truth", [
    (("--qk-layernorm",), "--qk-layernorm", "use_qk_norm false, without q/k norm"),
    (("--moe-router-topk-scaling-factor", "2.5"), "--moe-router-topk-scaling-factor 2.5", "routed_scaling_factor 1"),
    (("--rotary-percent", "1.0"), "--rotary-percent 1", "partial_rotary_factor 0.5"),
    (("--moe-router-score-function", "softmax"), "--moe-router-score-function softmax",
     "model_type 'glm4_moe', whose router is a sigmoid"),
    (("--moe-layer-freq", "[0]*2+[1]*44"), "--moe-layer-freq [0]*2+[1]*44",
     "first_k_dense_replace 1: MoE layers [0]*1+[1]*45"),
    (("--moe-router-num-groups", "8"), "--moe-router-num-groups 8", "n_group 1"),
])
def test_glm4_5_air_model_file_that_differs_is_named(change, claim, truth, tmp_path):
    """Each GLM-specific flag compared with the key of config.json it describes (values worked out from the
    published file: use_qk_norm false, routed_scaling_factor 1.0, partial_rotary_factor 0.5, first_k_dense_replace
    1, n_group 1); slime's own file as written passes the same check."""
    tokens = GLM4_5_AIR.split()
    _check(tmp_path, "glm4_5_air.json", tokens, UNSUPPORTED)
    tokens = _replace(tokens, change[0], change[1]) if change[0] in tokens else tokens + list(change)
    message = _refused(tmp_path, "glm4_5_air.json", tokens, UNSUPPORTED)
    assert f"{claim}: " in message and truth in message, message


def test_glm4_9b_model_file_agrees_and_plans(tmp_path, capsys):
    """slime's scripts/models/glm4-9B.sh (as run-glm4-9B.sh gives it, with its spec function) against GLM-Z1-9B-0414's
    published config.json: every flag agrees (the norms after attention and the MLP, interleaved rotary pairs on
    half of each head, q/k/v biases, 2 query groups, head width 4096 / 32 = head_dim 128) and the dry run plans it."""
    hf = _checkpoint(tmp_path, "glm_z1_9b.json")
    cfg = _check(tmp_path, "glm_z1_9b.json", GLM4_9B.split())
    assert cfg.model.megatron_model_args["--spec"] == ["slime_plugins.models.glm4", "get_glm_spec"]
    argv = ["--hf-checkpoint", str(hf), "--prompt-data", "/data/not-here.jsonl", "--rollout-batch-size", "16",
            "--num-rollout", "1", "--rm-type", "math", "--rollout-backend", "sglang", "--actor-num-nodes", "1",
            "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4", "--dry-run", "--cluster", "1x8",
            *GLM4_9B.split()]
    rc, captured = train_main(argv), capsys.readouterr()
    assert rc == 0, captured.err
    assert "glm4" in captured.out and "flags agree" in captured.out, captured.out


@pytest.mark.parametrize("flag, claim, truth", [
    ("--post-self-attn-layernorm", "no --post-self-attn-layernorm (Megatron-LM builds no norm after attention)",
     "model_type 'glm4', with a norm of the attention's and of the MLP's output"),
    ("--post-mlp-layernorm", "no --post-mlp-layernorm (Megatron-LM builds no norm after the MLP)",
     "model_type 'glm4', with a norm of the attention's and of the MLP's output"),
    ("--rotary-interleaved", "no --rotary-interleaved (Megatron-LM rotates the two halves of each head)",
     "model_type 'glm4', whose rotary channels rotate in interleaved pairs"),
    ("--add-qkv-bias", "no --add-qkv-bias (with --disable-bias-linear", "attention_bias true"),
])
def test_glm4_9b_model_file_without_a_glm4_switch_is_named(flag, claim, truth, tmp_path):
    """Left out of glm4-9B.sh's whole MODEL_ARGS, each GLM-4 switch is Megatron-LM's other model (no post norms,
    halves rotated, no q/k/v bias): refused naming it and what GLM-Z1-9B's config.json says."""
    message = _refused(tmp_path, "glm_z1_9b.json", _without(GLM4_9B.split(), flag))
    assert message.startswith(claim) and f"config.json says {truth}" in message, message


def test_glm4_spec_function_is_glm4s_only(tmp_path):
    """slime's GLM-4 spec function is accepted for glm4 (the local spec builds the same model), another spec
    function is not; on another family the GLM-4 one is refused (test_spec_local_only)."""
    tokens = GLM4_9B.split()
    assert tokens[:3] == ["--spec", "slime_plugins.models.glm4", "get_glm_spec"]
    _check(tmp_path, "glm_z1_9b.json", tokens[3:] + ["--spec", "local"])
    tokens = tokens[3:] + ["--spec", "slime_plugins.models.qwen3_next", "get_qwen3_next_spec"]
    message = _refused(tmp_path, "glm_z1_9b.json", tokens)
    assert message.startswith("--spec slime_plugins.models.qwen3_next get_qwen3_next_spec: "), message


def test_minimax_m2_model_file_agrees_and_plans(tmp_path, capsys):
    """slime's scripts/models/minimax-m2.sh (with its spec function) against MiniMax-M2.5's published config.json:
    every flag agrees (head width 128, rotary_dim 64 of 128 = --rotary-percent 0.5, the q/k norms, a sigmoid router
    with the expert bias, 256 experts of intermediate_size 1536 in all 62 layers) and the dry run plans it with EP 8."""
    hf = _checkpoint(tmp_path, "minimax_m2_5.json")
    cfg = _check(tmp_path, "minimax_m2_5.json", MINIMAX_M2.split())
    assert cfg.model.megatron_model_args["--spec"] == ["slime_plugins.models.minimax_m2", "get_minimax_m2_layer_spec"]
    rc, captured = train_main(_moe_dry_run_argv(hf, *MINIMAX_M2.split())), capsys.readouterr()
    assert rc == 0, captured.err
    assert "minimax_m2" in captured.out and "256 experts, top-8, in 62 layers" in captured.out, captured.out
    # use_mtp with num_mtp_modules 3: the MTP modules after the 62 decoder layers are named as not trained
    assert "3 multi-token-prediction layer(s) (num_mtp_modules" in captured.err, captured.err


@pytest.mark.parametrize("change, claim, truth", [
    (("--rotary-percent", "1.0"), "--rotary-percent 1", "rotary_dim / head_dim 0.5"),
    (("--moe-ffn-hidden-size", "3072"), "--moe-ffn-hidden-size 3072", "intermediate_size 1536"),
    (("--moe-router-score-function", "softmax"), "--moe-router-score-function softmax",
     "model_type 'minimax_m2', whose router is a sigmoid"),
    (("--moe-router-topk-scaling-factor", "2.5"), "--moe-router-topk-scaling-factor 2.5",
     "model_type 'minimax_m2', which scales no routing weight"),
    (("--moe-router-num-groups", "8"), "--moe-router-num-groups 8", "model_type 'minimax_m2', which routes over all "
     "experts at once"),
    (("--moe-shared-expert-intermediate-size", "1536"), "--moe-shared-expert-intermediate-size 1536",
     "model_type 'minimax_m2', without a shared expert"),
    (("--spec", "slime_plugins.models.glm4"), "--spec slime_plugins.models.glm4 get_minimax_m2_layer_spec",
     "model_type 'minimax_m2', which the trainer builds with megatron-core's local layer spec"),
])
def test_minimax_m2_model_file_that_differs_is_named(change, claim, truth, tmp_path):
    """Each flag of minimax-m2.sh changed is refused naming the flag, its value and the config.json key with its
    value (worked out from the published file: rotary_dim 64 / head_dim 128, intermediate_size 1536, no
    routed_scaling_factor, no groups, no shared expert)."""
    tokens = MINIMAX_M2.split()
    tokens = _replace(tokens, change[0], change[1]) if change[0] in tokens else tokens + list(change)
    message = _refused(tmp_path, "minimax_m2_5.json", tokens)
    assert f"{claim}: " in message and f"config.json says {truth}" in message, message


@pytest.mark.parametrize("flag, claim, truth", [
    ("--qk-layernorm", "no --qk-layernorm (Megatron-LM builds no q/k norm)",
     "model_type 'minimax_m2', with q_norm / k_norm over all heads' channels together"),
    ("--moe-router-enable-expert-bias", "no --moe-router-enable-expert-bias (Megatron-LM's router adds no expert bias)",
     "model_type 'minimax_m2', whose router chooses by score + e_score_correction_bias"),
    ("--rotary-percent", "no --rotary-percent (Megatron-LM rotates the whole head)", "rotary_dim / head_dim 0.5"),
    ("--untie-embeddings-and-output-weights", "no --untie-embeddings-and-output-weights", "tie_word_embeddings false"),
])
def test_minimax_m2_model_file_without_a_switch_is_named(flag, claim, truth, tmp_path):
    message = _refused(tmp_path, "minimax_m2_5.json", _without(MINIMAX_M2.split(), flag))
    assert message.startswith(claim) and f"config.json says {truth}" in message, message


def test_rotary_interleaved_on_multi_latent_attention_is_named(tmp_path):
    message = _refused(tmp_path, "deepseek_v3.json", DEEPSEEK_V3.split() + ["--rotary-interleaved"], UNSUPPORTED)
    assert message.startswith("--rotary-interleaved: ") and "multi-latent attention" in message, message


# ---- the whole dry run from a folder that holds only config.json
def _moe_dry_run_argv(hf: Path, *model_args: str) -> list[str]:
    return ["--hf-checkpoint", str(hf), "--prompt-data", "/data/not-here.jsonl", "--rollout-batch-size", "8",
            "--n-samples-per-prompt", "8", "--num-rollout", "1", "--rm-type", "math", "--rollout-backend", "sglang",
            "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--expert-model-parallel-size", "8",
            "--rollout-num-gpus", "8", "--dry-run", "--cluster", "2x8", *model_args]


def test_a_dry_run_with_the_model_args_plans_and_says_they_agree(tmp_path, capsys):
    hf = _checkpoint(tmp_path, "qwen3_30b_a3b.json")
    code = train_main(_moe_dry_run_argv(hf, *QWEN3_30B_A3B.split()))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "trainer: 8 ranks" in out and "qwen3_moe" in out
    # 28 flags in the model file; the trainer section's --moe-token-dispatcher-type, --moe-aux-loss-coeff and
    # --moe-grouped-gemm aside, 25 are MODEL_ARGS, 2 of them kernel or token-dropping choices without effect here
    assert (f"note: slime's MODEL_ARGS: 23 flags agree with {hf}'s config.json, from which the model is built; "
            "--moe-token-drop-policy, --moe-permute-fusion accepted without effect") in out, out


def test_a_dry_run_with_only_kernel_flags_says_they_have_no_effect(tmp_path, capsys):
    hf = _checkpoint(tmp_path, "qwen3_30b_a3b.json")
    assert train_main(_moe_dry_run_argv(hf, "--moe-permute-fusion")) == 0
    assert "note: slime's MODEL_ARGS: --moe-permute-fusion accepted without effect here " \
           "(docs/flags.md says why)\n" in capsys.readouterr().out


def test_a_dry_run_with_a_model_file_of_another_size_exits_2_naming_the_flag(tmp_path, capsys):
    hf = _checkpoint(tmp_path, "qwen3_30b_a3b.json")
    code = train_main(_moe_dry_run_argv(hf, *_replace(QWEN3_30B_A3B.split(), "--num-experts", "64")))
    err = capsys.readouterr().err
    assert code == 2
    assert f"--num-experts 64: --hf-checkpoint {hf}'s config.json says num_experts 128; slime's MODEL_ARGS" in err


def test_a_moving_expert_bias_is_refused_naming_the_flag(tmp_path):
    """--moe-router-bias-update-rate other than 0 would move the trainer's expert bias away from the one the
    engines route with: refused before anything starts, naming the flag (slime's scripts give 0)."""
    tokens = _replace(GLM4_5_AIR.split(), "--moe-router-bias-update-rate", "0.001")
    with pytest.raises(ConfigError, match=r"--moe-router-bias-update-rate must be 0: .*got 0.001"):
        _check(tmp_path, "glm4_5_air.json", tokens, UNSUPPORTED)


def test_deepseek_v3_model_file_agrees_and_plans(tmp_path, capsys):
    """slime's scripts/models/deepseek-v3.sh against DeepSeek-V3's published config.json: multi-latent attention
    (ranks 1536 / 512, head widths 128 + 64 and 128), YaRN (factor 40, mscale 1, mscale_all_dim 1), the 3 dense
    layers, 256 experts in 8 groups (4 taken), scaling 2.5, the expert bias: every flag agrees, and the dry run
    plans it on 4 x 8 GPUs with EP 8."""
    hf = _checkpoint(tmp_path, "deepseek_v3.json", UNSUPPORTED)
    _check(tmp_path, "deepseek_v3.json", DEEPSEEK_V3.split(), UNSUPPORTED)
    argv = ["--hf-checkpoint", str(hf), "--prompt-data", "/data/not-here.jsonl", "--rollout-batch-size", "16",
            "--num-rollout", "1", "--rm-type", "math", "--rollout-backend", "sglang", "--actor-num-nodes", "2",
            "--actor-num-gpus-per-node", "8", "--expert-model-parallel-size", "8", "--rollout-num-gpus", "16",
            "--dry-run", "--cluster", "4x8", *DEEPSEEK_V3.split()]
    rc, captured = train_main(argv), capsys.readouterr()
    assert rc == 0, captured.err
    # 61 layers less first_k_dense_replace 3 dense: 58 MoE layers of 256 experts, top 8
    assert "deepseek_v3" in captured.out and "256 experts, top-8, in 58 layers" in captured.out, captured.out


@pytest.mark.parametrize("change, claim, truth", [
    (("--q-lora-rank", "1024"), "--q-lora-rank 1024", "q_lora_rank 1536"),
    (("--kv-lora-rank", "256"), "--kv-lora-rank 256", "kv_lora_rank 512"),
    (("--qk-pos-emb-head-dim", "32"), "--qk-pos-emb-head-dim 32", "qk_rope_head_dim 64"),
    (("--v-head-dim", "64"), "--v-head-dim 64", "v_head_dim 128"),
    (("--rotary-scaling-factor", "32"), "--rotary-scaling-factor 32", "rope_scaling.factor 40"),
    (("--moe-router-group-topk", "2"), "--moe-router-group-topk 2", "topk_group 4"),
])
def test_deepseek_v3_model_file_that_differs_is_named(change, claim, truth, tmp_path):
    """Each MLA / YaRN / group flag compared with the config.json key it describes (values from the published
    file)."""
    tokens = DEEPSEEK_V3.split()
    tokens = _replace(tokens, change[0], change[1]) if change[0] in tokens else tokens + list(change)
    message = _refused(tmp_path, "deepseek_v3.json", tokens, UNSUPPORTED)
    assert f"{claim}: " in message and truth in message, message


# scripts/models/glm5-744B-A40B.sh and glm5.2-744B-A40B.sh as bash expands them (the same MODEL_ARGS but the rotary
# base; --moe-layer-freq is Megatron's Python expression of 3 dense and 75 MoE layers)
GLM5 = """--spec slime_plugins.models.glm5.glm5 get_glm5_spec --moe-layer-freq [0]*3+[1]*75 --num-experts 256
--moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 --moe-grouped-gemm --moe-permute-fusion
--moe-ffn-hidden-size 2048 --moe-router-score-function sigmoid --moe-router-pre-softmax --moe-router-enable-expert-bias
--moe-router-bias-update-rate 0 --moe-router-load-balancing-type seq_aux_loss --moe-router-topk-scaling-factor 2.5
--moe-aux-loss-coeff 0 --moe-router-dtype fp32 --make-vocab-size-divisible-by 16 --num-layers 78 --hidden-size 6144
--ffn-hidden-size 12288 --num-attention-heads 64 --disable-bias-linear --swiglu --untie-embeddings-and-output-weights
--position-embedding-type rope --no-position-embedding --normalization RMSNorm --qk-layernorm --multi-latent-attention
--q-lora-rank 2048 --kv-lora-rank 512 --qk-head-dim 192 --v-head-dim 256 --kv-channels 192 --qk-pos-emb-head-dim 64
--vocab-size 154880 --rotary-base {base} --enable-experimental --allgather-cp"""


@pytest.mark.parametrize("model, base", [("GLM-5", 1000000), ("GLM-5.2-FP8", 8000000)])
def test_glm5_model_files_agree_and_plan(model, base, tmp_path, capsys):
    """slime's GLM-5 and GLM-5.2 MODEL_ARGS (slime's own spec for the family, multi-latent attention of ranks 2048 /
    512 and head widths 192 + 64 and 256, the 3 dense layers, 256 experts top-8 with one shared, scaling 2.5, the
    expert bias) against the config.json of tests/migration/hf_configs: every flag agrees, and the dry run plans it
    on 8 x 8 GPUs with EP 16 (the sparse attention's indexer has no Megatron flag: it comes from config.json)."""
    tokens, sglang = GLM5.format(base=base).split(), ["--rollout-backend", "sglang"]
    shutil.copy(MIGRATION / model / "config.json", tmp_path / "glm5.json")
    # slime's GLM-5 spec function accepted for the family, and its --freeze-indexer (always so here)
    _check(tmp_path, "glm5.json", tokens + sglang + ["--freeze-indexer"], tmp_path)
    message = _refused(tmp_path, "glm5.json", tokens[3:] + ["--spec", "slime_plugins.models.glm4", "get_glm_spec"]
                       + sglang, tmp_path)
    assert message.startswith("--spec slime_plugins.models.glm4 get_glm_spec: "), message
    message = _refused(tmp_path, "glm5.json", _replace(tokens, "--rotary-base", str(base * 2)) + sglang, tmp_path)
    assert f"--rotary-base {base * 2}: " in message and f"rope_theta {base}" in message, message
    message = _refused(tmp_path, "glm5.json", tokens + ["--rollout-backend", "embedded"], tmp_path)
    assert "whose sparse attention (its indexer's key cache beside the key/value cache) the built-in engine does " \
           "not serve; use --rollout-backend sglang" in message, message
    two = ["--actor-num-gpus-per-node", "2"]
    if model == "GLM-5.2-FP8":  # 39 + 39 layers: the second stage would start on a layer sharing layer 38's top-k
        message = _refused(tmp_path, "glm5.json", tokens + sglang + two + ["--pipeline-model-parallel-size", "2"],
                           tmp_path)
        assert "stages start at layers [0, 39], and layer(s) [39] reuse an earlier layer's top-k" in message, message
        pp = ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "38"]
        _check(tmp_path, "glm5.json", tokens + sglang + two + pp, tmp_path)  # stages start on layers 0 and 38
        message = _refused(tmp_path, "glm5.json", tokens + sglang + two + pp + [
            "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
            "--no-pack-sequences"], tmp_path)
        assert "--no-pack-sequences with --recompute-granularity full and --pipeline-model-parallel-size 2: " \
               "glm_moe_dsa's layers that share" in message, message
    argv = ["--hf-checkpoint", str(tmp_path / "glm5"), "--prompt-data", "/data/not-here.jsonl",
            "--rollout-batch-size", "16", "--num-rollout", "1", "--rm-type", "math", "--rollout-backend", "sglang",
            "--actor-num-nodes", "4", "--actor-num-gpus-per-node", "8", "--expert-model-parallel-size", "16",
            "--tensor-model-parallel-size", "2", "--sequence-parallel", "--rollout-num-gpus", "32", "--dry-run",
            "--cluster", "8x8", *tokens]
    rc, captured = train_main(argv), capsys.readouterr()
    assert rc == 0, captured.err
    assert "glm_moe_dsa" in captured.out and "256 experts, top-8, in 75 layers" in captured.out, captured.out


def test_multi_latent_attention_on_a_model_without_it_is_named(tmp_path):
    message = _refused(tmp_path, "glm4_5_air.json", GLM4_5_AIR.split() + ["--multi-latent-attention"], UNSUPPORTED)
    assert "--multi-latent-attention: " in message and "which has no multi-latent attention" in message, message


# scripts/models/glm4.7-30B-A3B.sh, as bash expands it
GLM47_FLASH = """--moe-layer-freq [0]*1+[1]*46 --num-experts 64 --moe-shared-expert-intermediate-size 1536
--moe-router-topk 4 --moe-grouped-gemm --moe-permute-fusion --moe-ffn-hidden-size 1536
--moe-router-score-function sigmoid --moe-router-pre-softmax --moe-router-enable-expert-bias
--moe-router-bias-update-rate 0
--moe-router-load-balancing-type seq_aux_loss --moe-router-topk-scaling-factor 1.8 --moe-aux-loss-coeff 0
--moe-router-dtype fp32 --make-vocab-size-divisible-by 64 --num-layers 47 --hidden-size 2048 --ffn-hidden-size 10240
--num-attention-heads 20 --disable-bias-linear --add-qkv-bias --swiglu --untie-embeddings-and-output-weights
--position-embedding-type rope --no-position-embedding --normalization RMSNorm --qk-layernorm --multi-latent-attention
--q-lora-rank 768 --kv-lora-rank 512 --qk-head-dim 192 --v-head-dim 256 --kv-channels 192 --qk-pos-emb-head-dim 64
--vocab-size 154880 --rotary-base 1000000 --no-rope-fusion"""


def test_glm4_7_flash_model_file_agrees_with_its_mtp_layer(tmp_path):
    """slime's scripts/models/glm4.7-30B-A3B.sh against GLM-4.7-Flash's config.json: every flag agrees (its
    --add-qkv-bias too: Megatron-LM's multi-latent attention takes no bias, as config.json says; no --norm-epsilon:
    Megatron-LM's 1e-05 is transformers' default rms_norm_eps for glm4_moe_lite), and the run script's MTP flags
    (--mtp-num-layers 1 --enable-mtp-training --mtp-loss-scaling-factor 0.2) build its one MTP layer
    (num_nextn_predict_layers 1)."""
    cfg = _check(tmp_path, "config.json", [*GLM47_FLASH.split(), "--mtp-num-layers", "1", "--enable-mtp-training",
                                           "--mtp-loss-scaling-factor", "0.2"], MIGRATION / "GLM-4.7-Flash")
    assert (cfg.trainer.mtp_num_layers, cfg.trainer.enable_mtp_training, cfg.trainer.mtp_loss_scaling_factor) == (
        1, True, 0.2)
