"""The --dry-run estimates (orchestration/estimate.py): parameter counts against transformers' own
models built on the meta device from the same config.json, and the memory pieces against hand
arithmetic on a small case. The config.json files under hf_configs/ are the hub's for those models."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from slime_rl.orchestration.estimate import (
    LOGITS_BYTES,
    TrainerLayout,
    activation_bytes_per_token,
    estimate_memory,
    estimate_sync,
    model_shape,
    stage_activation_bytes,
)

CONFIGS = Path(__file__).parent / "hf_configs"
FILES = sorted(p.name for p in CONFIGS.glob("*.json"))


def hf_config(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def transformers_param_count(cfg: dict) -> int:
    """Parameters of transformers' model class for this config, built on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from slime_rl.config.families import transformers_config

    config = transformers_config(cfg)  # Kimi-K2: DeepSeek-V3's classes
    auto = AutoModelForImageTextToText if cfg["model_type"] == "qwen2_5_vl" else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    return sum(p.numel() for p in model.parameters())


def test_every_registry_family_has_a_config_here():
    from slime_rl.trainer.convert import FAMILIES

    assert set(FAMILIES) <= {hf_config(f)["model_type"] for f in FILES}


@pytest.mark.parametrize("name", FILES)
def test_param_count_equals_transformers_model_on_meta(name):
    cfg = hf_config(name)
    assert model_shape(cfg, where=name).params == transformers_param_count(cfg)


@pytest.mark.parametrize("name", [f for f in FILES if hf_config(f)["model_type"] != "qwen3_moe"])
def test_param_count_equals_the_trainer_registry_shapes(name):
    """The trainer's own HF name/shape map (config/families.py) sums to the same count."""
    from slime_rl.trainer.convert import arch_from_hf_config, hf_shapes

    cfg = hf_config(name)
    arch = arch_from_hf_config(cfg)
    # a router's expert bias is a buffer in transformers' model (no parameter), a tensor of the checkpoint
    buffers = {n for pm in arch.param_maps() if pm.buffer for n in pm.hf}
    registry = sum(math.prod(s) for n, s in hf_shapes(arch).items() if n not in buffers)
    assert model_shape(cfg).params == registry


def test_param_count_tiny_llama_by_hand():
    cfg = {"model_type": "llama", "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 10, "tie_word_embeddings": True}
    # head_dim 2: q 8, k/v 4 each; per layer: q 8*8 + k 8*4 + v 8*4 + o 8*8 = 192, MLP 3*8*12 = 288, norms 16
    per_layer = 192 + 288 + 16
    assert model_shape(cfg).params == 2 * per_layer + 8 + 10 * 8  # + final norm + one (tied) embedding
    assert model_shape({**cfg, "tie_word_embeddings": False}).params == 2 * per_layer + 8 + 2 * 10 * 8


def test_param_count_glm_z1_9b_by_hand():
    """GLM-Z1-9B-0414's published config.json, counted by hand: per layer q 4096x4096 + k, v 4096x256 each, their
    biases, o 4096x4096, gate_up_proj 2x13696x4096, down 4096x13696 and four norms (input, post-attention, the
    pre-MLP one HF calls post_attention_layernorm, post-MLP); 40 layers, the final norm, untied embedding and LM
    head of 151552 x 4096: 9.40e9, the "9B" of its name (its model card: 9.4B)."""
    h, f, q, kv, vocab = 4096, 13696, 32 * 128, 2 * 128, 151552
    per_layer = h * q + q + 2 * (h * kv + kv) + q * h + 2 * f * h + h * f + 4 * h
    total = 40 * per_layer + h + 2 * vocab * h
    assert total == 9_400_279_040
    assert model_shape(hf_config("glm_z1_9b.json")).params == total


def test_param_count_qwen3_next_80b_a3b_by_hand():
    """Qwen3-Next-80B-A3B's published config.json, counted by hand: 48 layers, every fourth (full_attention_interval
    4) full attention: q_proj 2048 x (16 heads x 256 x 2: each head's query and output gate), k and v 2048 x 2 x 256,
    o_proj 4096 x 2048, q/k norms 256 each; the other 36 Gated DeltaNet: in_proj_qkvz 2048 x (2 x 16 x 128 + 2 x 32 x
    128), in_proj_ba 2048 x 64, conv1d (2 x 2048 + 4096) x 4, dt_bias and A_log 32 each, out_proj 4096 x 2048, the
    gated norm 128; every layer two norms and an MoE block of 512 experts of 3 x 2048 x 512, the router 512 x 2048,
    the shared expert 3 x 2048 x 512 and its gate 2048; the final norm, untied embedding and LM head 151936 x 2048:
    79.67e9, the "80B" of its name."""
    h, vocab, q, kv, kd, vd, nv = 2048, 151936, 16 * 256, 2 * 256, 16 * 128, 32 * 128, 32
    full = h * 2 * q + 2 * h * kv + q * h + 2 * 256 + 2 * h
    linear = h * (2 * kd + 2 * vd) + h * 2 * nv + (2 * kd + vd) * 4 + 2 * nv + vd * h + 128 + 2 * h
    moe = 512 * 3 * h * 512 + 512 * h + 3 * h * 512 + h
    total = 12 * full + 36 * linear + 48 * moe + h + 2 * vocab * h
    assert total == 79_674_391_296
    shape = model_shape(hf_config("qwen3_next_80b_a3b.json"))
    assert shape.params == total and shape.linear_layers == tuple(i for i in range(48) if (i + 1) % 4)


@pytest.mark.parametrize("name,h,heads,ffn,layers,nv,want", [
    ("qwen3_5_9b.json", 4096, 16, 12288, 32, 32, 8_953_803_264),
    ("qwen3_5_27b.json", 5120, 24, 17408, 64, 48, 26_895_998_464)])
def test_param_count_qwen3_5_text_decoder_by_hand(name, h, heads, ffn, layers, nv, want):
    """Qwen3.5-9B / 27B's text decoder (these files have no vision_config: the trainer builds it alone), from the
    config.json's text_config, counted by hand: every fourth layer full attention (q_proj h x heads x 256 x 2, k and v
    h x 4 x 256, o_proj, q/k norms 256 each), the others Gated DeltaNet (in_proj_qkv h x (2 x 16 x 128 + nv x 128),
    in_proj_z h x nv x 128, in_proj_b and in_proj_a h x nv, conv1d (2 x 2048 + nv x 128) x 4, dt_bias and A_log nv
    each, out_proj, the gated norm 128), every layer two norms and a dense SwiGLU MLP 3 x h x ffn; the final norm,
    untied embedding and LM head 248320 x h: 8.95e9 and 26.9e9 (the 9B / 27B of the names count the vision tower
    too)."""
    vocab, q, kv, kd, vd = 248320, heads * 256, 4 * 256, 16 * 128, nv * 128
    full = h * 2 * q + 2 * h * kv + q * h + 2 * 256 + 2 * h
    linear = h * (2 * kd + vd) + h * vd + 2 * h * nv + (2 * kd + vd) * 4 + 2 * nv + vd * h + 128 + 2 * h
    total = layers // 4 * full + layers * 3 // 4 * linear + layers * 3 * h * ffn + h + 2 * vocab * h
    assert total == want
    shape = model_shape(hf_config(name))
    assert shape.params == total and shape.linear_layers == tuple(i for i in range(layers) if (i + 1) % 4)
    assert shape.experts == 0


def test_param_count_qwen3_5_moe_35b_a3b_text_decoder_by_hand():
    """Qwen3.5-35B-A3B's text decoder (its config.json as published: text_config without intermediate_size, no dense
    MLP anywhere) counted by hand: every fourth of its 40 layers full attention (q_proj 2048 x 16 x 256 x 2, k and v
    2048 x 2 x 256, o_proj, q/k norms 256 each), the others Gated DeltaNet (16 key heads and 32 value heads of 128),
    every layer two norms, the router 256 x 2048, 256 experts 3 x 2048 x 512, the shared expert 3 x 2048 x 512 and its
    gate 2048; the final norm, untied embedding and LM head 248320 x 2048: 34.66e9, 256 experts in all 40 layers."""
    h, heads, layers, nv, experts, width, vocab = 2048, 16, 40, 32, 256, 512, 248320
    q, kv, kd, vd = heads * 256, 2 * 256, 16 * 128, nv * 128
    full = h * 2 * q + 2 * h * kv + q * h + 2 * 256 + 2 * h
    linear = h * (2 * kd + vd) + h * vd + 2 * h * nv + (2 * kd + vd) * 4 + 2 * nv + vd * h + 128 + 2 * h
    moe = experts * h + experts * 3 * h * width + 3 * h * width + h
    total = layers // 4 * full + layers * 3 // 4 * linear + layers * moe + h + 2 * vocab * h
    assert total == 34_660_610_688
    shape = model_shape(hf_config("qwen3_5_35b_a3b.json"))
    assert shape.params == total and shape.linear_layers == tuple(i for i in range(layers) if (i + 1) % 4)
    assert (shape.experts, shape.top_k, shape.expert_ffn, shape.shared_ffn, shape.moe_layers) == (
        256, 8, 512, 512, tuple(range(layers)))


def test_activation_bytes_of_a_gated_delta_net_layer_by_hand():
    """One Gated DeltaNet layer of Qwen3-Next-80B-A3B per token (module docstring's rows), TP 2 without sequence
    parallelism: norms 8h whole; convolution 4(2kd + vd), q/k 4kd + 4 nv dk, v/g/beta 2vd + 6nv, gated norm 8vd,
    halved; its MoE block as any (top-10 experts, the router's logits, the shared expert)."""
    shape = model_shape(hf_config("qwen3_next_80b_a3b.json"))
    h, kd, vd, nv, dk = 2048, 2048, 4096, 32, 128
    mixer = 4 * (2 * kd + vd) + 4 * kd + 4 * nv * dk + 2 * vd + 6 * nv + 8 * vd
    moe = 8 * 10 * 512 / 2 + 4 * 512 + 8 * 512 / 2
    assert activation_bytes_per_token(shape, TrainerLayout(tp=2), layer=0) == 8 * h + mixer / 2 + moe
    # layer 3 is full attention: q (16 x 256), k/v (2 x 256), the output gate's rows, q/k norms
    q, kv = 4096, 512
    attention = 2 * (q + 2 * kv) + 2 * q + 4 * 16 + 2 * (q + kv) + 2 * q
    assert activation_bytes_per_token(shape, TrainerLayout(tp=2), layer=3) == 8 * h + attention / 2 + moe


def test_param_count_of_the_tiny_glm4_is_its_weights(tiny_glm4):
    """The tiny GLM-4 folder (tools/make_tiny_model.py --arch glm4): the estimate from its config.json equals the
    elements of its model.safetensors, and of transformers' model loaded from it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = json.loads((tiny_glm4 / "config.json").read_text())
    stored = sum(t.numel() for t in load_file(tiny_glm4 / "model.safetensors").values())
    model = AutoModelForCausalLM.from_pretrained(tiny_glm4)
    assert model_shape(cfg).params == stored == sum(p.numel() for p in model.parameters())


def test_lora_params_of_glm4_leave_its_gate_up_proj():
    """--lora-rank 8 on all-linear of GLM-Z1-9B, by hand: q, k, v, o and down_proj per layer take adapters, the
    one-tensor gate_up_proj none (convert/lora_targets.py leaves it)."""
    shape = model_shape(hf_config("glm_z1_9b.json"))
    h, f, q, kv, r = 4096, 13696, 4096, 256, 8
    split, rep = shape.lora_params(r, ("all-linear",))
    assert split == r * (q + 2 * kv) + r * q + r * f  # column B [out, r] split, row A [r, in] split
    assert rep == r * 3 * h + r * h + r * h  # column A [r, in] whole, row B [out, r] whole


def test_unknown_model_type_names_the_file():
    with pytest.raises(ValueError, match=r"m/config.json: model_type 'gpt2' cannot be estimated"):
        model_shape({"model_type": "gpt2"}, where="m/config.json")


# A small dense case worked by hand: h 64, f 128, 4 heads of 16, 2 KV heads, vocab 100 (untied), 4 layers.
SMALL = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": False}


def test_activation_bytes_per_token_by_hand():
    shape = model_shape(SMALL)
    # no parallelism: norms 8*64 = 512; q,k,v 2*(64 + 2*32) = 256; attention out 2*64 = 128; lse 4*4 = 16;
    # SwiGLU 8*128 = 1024
    assert activation_bytes_per_token(shape, TrainerLayout()) == 512 + 256 + 128 + 16 + 1024
    # TP 2 without sequence parallel: the norms' part stays whole, the rest halves
    assert activation_bytes_per_token(shape, TrainerLayout(tp=2)) == 512 + (256 + 128 + 16 + 1024) / 2
    # with sequence parallel everything is split
    assert activation_bytes_per_token(shape, TrainerLayout(tp=2, sequence_parallel=True)) == (1936) / 2
    # k/v expanded to the query heads (torch without varlen GQA): k, v take 2*64 each instead of 2*32
    assert activation_bytes_per_token(shape, TrainerLayout(gqa_expanded=True)) == 1936 + 2 * 2 * (64 - 32)


def test_activation_bytes_of_glm4_post_norms_by_hand():
    """SMALL as a GLM-4 (q/k/v biases as qwen2): its two post norms keep their inputs, 2 x 2 x 64 bytes a token,
    split over TP only under sequence parallelism, as the other norms."""
    shape = model_shape({**SMALL, "model_type": "glm4", "head_dim": 16, "attention_bias": True})
    assert activation_bytes_per_token(shape, TrainerLayout()) == 512 + 256 + 128 + 16 + 1024 + 256
    assert activation_bytes_per_token(shape, TrainerLayout(tp=2)) == 512 + 256 + (256 + 128 + 16 + 1024) / 2
    assert activation_bytes_per_token(shape, TrainerLayout(tp=2, sequence_parallel=True)) == (1936 + 256) / 2


def test_recompute_by_hand():
    shape = model_shape(SMALL)
    tokens, layer, layer_input = 100, 1936 * 100, 2 * 64 * 100
    base = TrainerLayout(tokens_per_micro_batch=tokens)
    final_norm = 4 * 64 * tokens
    assert stage_activation_bytes(shape, base, 0) == 4 * layer + final_norm
    full = dict(recompute_granularity="full")
    # uniform 1: 4 layer inputs kept, one layer recomputed at a time
    uni1 = TrainerLayout(tokens_per_micro_batch=tokens, recompute_method="uniform", recompute_num_layers=1, **full)
    assert stage_activation_bytes(shape, uni1, 0) == 4 * layer_input + layer + final_norm
    # uniform 2: 2 chunk inputs kept, one chunk of 2 layers recomputed at a time
    uni2 = TrainerLayout(tokens_per_micro_batch=tokens, recompute_method="uniform", recompute_num_layers=2, **full)
    assert stage_activation_bytes(shape, uni2, 0) == 2 * layer_input + 2 * layer + final_norm
    # block 1: the first layer's input only, the other 3 layers whole
    blk1 = TrainerLayout(tokens_per_micro_batch=tokens, recompute_method="block", recompute_num_layers=1, **full)
    assert stage_activation_bytes(shape, blk1, 0) == layer_input + 3 * layer + final_norm
    sel = TrainerLayout(tokens_per_micro_batch=tokens, recompute_granularity="selective")
    assert stage_activation_bytes(shape, sel, 0) == 4 * (layer - 16 * tokens) + final_norm


def test_memory_per_gpu_by_hand_tp2_pp2_dp2():
    shape = model_shape(SMALL)
    lay = TrainerLayout(tp=2, pp=2, dp=2, sequence_parallel=True, tokens_per_micro_batch=64)
    # one layer: attention q 64*64 + k,v 2*64*32 + o 64*64 + qkv bias (64 + 64) = 12416 -> 6208 per TP rank,
    # + 2 norms of 64 (replicated); MLP 3*64*128 = 24576 -> 12288 per TP rank
    layer = 6208 + 128 + 12288
    emb = 100 * 64 // 2  # vocab 100 splits evenly over TP 2
    stage0, stage1 = 2 * layer + emb, 2 * layer + 64 + emb  # stage 1: final norm + LM head
    tokens = 64
    act_layer = 1936 / 2 * tokens
    act0 = 2 * (2 * act_layer)  # 1F1B: stage 0 holds pp = 2 micro-batches of its 2 layers
    act1 = 2 * act_layer + 4 * 64 * tokens / 2
    logits = LOGITS_BYTES * tokens * 50
    total0 = stage0 * (2 + 4) + 12 * stage0 / 2 + act0
    total1 = stage1 * (2 + 4) + 12 * stage1 / 2 + act1 + logits
    mem = estimate_memory(shape, lay)
    assert mem.total == pytest.approx(max(total0, total1), abs=2)
    assert mem.stage == (0 if total0 > total1 else 1)
    assert mem.params == (stage0 if total0 > total1 else stage1)


def test_uneven_pipeline_stages_by_hand():
    """--decoder-first-pipeline-num-layers 1 at PP=2 on the 4-layer model: stage 0 holds the embedding and
    1 layer, stage 1 the other 3, the final norm and the LM head (the numbers of the TP2 x PP2 case above
    at TP 1); activations: 1 and 3 layers, the last stage also the final norm."""
    shape = model_shape(SMALL)
    layer = 12416 + 128 + 24576
    tokens, layer_act = 100, 1936 * 100
    lay = TrainerLayout(pp=2, tokens_per_micro_batch=tokens, micro_batches_in_flight=1, pipeline_layers=(1, 3))
    assert lay.stage_layers(4, 0) == (0, 1) and lay.stage_layers(4, 1) == (1, 3)
    assert stage_activation_bytes(shape, lay, 0) == layer_act
    assert stage_activation_bytes(shape, lay, 1) == 3 * layer_act + 4 * 64 * tokens
    mem = estimate_memory(shape, lay)
    assert mem.stage == 1 and mem.params == 3 * layer + 64 + 100 * 64


def test_distributed_optimizer_divides_by_dp_times_cp():
    shape = model_shape(SMALL)
    one = estimate_memory(shape, TrainerLayout(dp=1))
    four = estimate_memory(shape, TrainerLayout(dp=2, cp=2))
    assert one.weights == four.weights and one.grads == four.grads
    assert four.optimizer == pytest.approx(one.optimizer / 4, abs=1)
    assert one.optimizer == 12 * one.params and one.grads == 4 * one.params  # Megatron's table: 2 + 4 + 12 / d
    fp32 = estimate_memory(shape, TrainerLayout(bf16=False))
    assert fp32.weights == 4 * fp32.params and fp32.optimizer == 8 * fp32.params  # 4 + 4 + 8 / d


def test_optimizer_cpu_offload_moves_the_optimizer_term_to_the_host():
    """--optimizer-cpu-offload (megatron-core's HybridDeviceOptimizer, fraction f of the shard): the GPU
    keeps (1 - f) of the fp32 master + Adam term; the host holds f x (fp32 params 4 + grads 4 + Adam m, v 8)
    = 16 bytes per parameter of the shard (SGD: 12, momentum only); weights, grads and activations stay."""
    shape = model_shape(SMALL)
    base = estimate_memory(shape, TrainerLayout(dp=2))
    off = estimate_memory(shape, TrainerLayout(dp=2, optimizer_offload=1.0))
    half = estimate_memory(shape, TrainerLayout(dp=2, optimizer_offload=0.5))
    assert (off.weights, off.grads, off.activations, off.logits) == (base.weights, base.grads, base.activations,
                                                                     base.logits)
    assert base.host_optimizer == 0 and off.optimizer == 0
    assert off.host_optimizer == pytest.approx(16 * base.params / 2, abs=1)  # the DP=2 shard
    assert off.total == base.total - base.optimizer
    assert half.optimizer == pytest.approx(base.optimizer / 2, abs=1)
    assert half.host_optimizer == pytest.approx(off.host_optimizer / 2, abs=1)
    sgd = estimate_memory(shape, TrainerLayout(optimizer="sgd", optimizer_offload=1.0))
    assert sgd.optimizer == 0 and sgd.host_optimizer == pytest.approx(12 * sgd.params, abs=1)


def test_expert_parallel_splits_the_experts():
    shape = model_shape(hf_config("qwen3_30b_a3b.json"))
    ep1 = estimate_memory(shape, TrainerLayout(dp=8))
    ep8 = estimate_memory(shape, TrainerLayout(dp=8, ep=8))
    experts = 48 * 128 * 3 * 2048 * 768
    assert ep1.params - ep8.params == experts - experts // 8


def test_sync_time_is_bytes_over_bandwidth_plus_the_fixed_cost():
    shape = model_shape(hf_config("qwen2_5_7b_instruct.json"))
    sync = estimate_sync(shape, bf16=True, link="inter-node", gbps=50.0)
    assert sync.bytes == 2 * 7_615_616_512 and sync.gathered_bytes == 0  # TP 1: nothing to gather
    assert sync.seconds == pytest.approx(2 * 7_615_616_512 / 50e9 + 0.0035)


def test_sync_counts_the_expert_gather_to_the_source_rank():
    """Qwen3-30B-A3B at EP 8 (TP 1): the source rank receives the 7/8 of the routed experts the other
    expert ranks hold (48 MoE layers x 128 experts x 3 x 2048 x 768), in bf16, at the gather bandwidth;
    at TP 2 and EP 4 also half of every TP-split weight."""
    shape = model_shape(hf_config("qwen3_30b_a3b.json"))
    experts = 48 * 128 * 3 * 2048 * 768
    sync = estimate_sync(shape, bf16=True, link="intra-node", gbps=300.0, tp=1, ep=8, gather_gbps=200.0)
    assert sync.gathered_bytes == 2 * experts * 7 // 8
    assert sync.seconds == pytest.approx(2 * shape.params / 300e9 + 2 * experts * 7 / 8 / 200e9 + 0.0035)
    # TP-split outside the experts: per layer q (32 x 128 heads) and o, k and v (4 x 128), no MLP (every layer
    # is MoE); the embedding and the untied LM head (151936 x 2048 each)
    split = 48 * (2 * 2048 * 4096 + 2 * 2048 * 512) + 2 * 151936 * 2048
    tp2 = estimate_sync(shape, bf16=True, link="intra-node", gbps=300.0, tp=2, ep=4)
    assert tp2.gathered_bytes == round(2 * (split / 2 + experts * 7 / 8))  # expert TP = TP: 8 expert shards


def test_lora_memory_of_the_1_5b_shape_is_its_adapters_only():
    """--lora-rank 8 on every linear of Qwen2.5-1.5B: the trained parameters counted by hand from config.json
    (A [r, in] and B [out, r] of q, k, v, o, gate, up, down per layer); the gradient buffer and the optimizer's
    fp32 master + Adam m, v hold those only, under 2 % of full fine-tuning's optimizer state."""
    import json
    from pathlib import Path

    from slime_rl.orchestration.estimate import TrainerLayout, estimate_memory, model_shape

    cfg = json.loads((Path(__file__).parent / "hf_configs" / "qwen2_5_1_5b_instruct.json").read_text())
    shape = model_shape(cfg)
    h, f, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q = h  # 12 heads x 128
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    r = 8
    adapters = layers * r * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h))
    full = estimate_memory(shape, TrainerLayout(bf16=True))
    lora = estimate_memory(shape, TrainerLayout(bf16=True, lora_rank=r))
    assert lora.grads == adapters * 4
    assert lora.optimizer == adapters * 12  # fp32 master + m + v, one DP rank
    assert lora.weights == full.weights + adapters * 2  # the frozen bf16 base and the bf16 adapters
    assert lora.optimizer / full.optimizer < 0.02
    two = estimate_memory(shape, TrainerLayout(bf16=True, lora_rank=r, tp=2, dp=2))
    split = layers * r * (q + 2 * kv + f * 2 + q + f)  # B of column linears, A of row linears: halved by TP 2
    assert two.optimizer == (adapters - split // 2) * 12 // 2


def test_param_count_minimax_m2_5_by_hand():
    """MiniMax-M2.5's published config.json, counted by hand: per layer q 3072x6144 + k, v 3072x1024 each, o
    6144x3072, the q/k norms over all heads (6144 and 1024 wide, not 2 x head_dim), two RMSNorms, the router
    256x3072 and 256 experts of 3 x 3072 x 1536 (intermediate_size is each expert's width; no shared expert, no
    dense layer); 62 layers, the final norm, untied embedding and LM head of 200064 x 3072: 228.7e9, the "229B" of
    its model card. The router's e_score_correction_bias is a buffer, not a parameter."""
    h, q, kv, experts, f, vocab = 3072, 48 * 128, 8 * 128, 256, 1536, 200064
    per_layer = h * q + 2 * h * kv + q * h + (q + kv) + 2 * h + experts * h + experts * 3 * h * f
    total = 62 * per_layer + h + 2 * vocab * h
    assert total == 228_689_748_992
    shape = model_shape(hf_config("minimax_m2_5.json"))
    assert (shape.experts, shape.expert_ffn, shape.top_k, len(shape.moe_layers), shape.shared_ffn) == (256, 1536, 8,
                                                                                                       62, 0)
    assert shape.params == total


def test_activation_bytes_of_minimax_m2_whole_qk_norms_by_hand():
    """SMALL as a MiniMax-M2 (every layer 4 experts of 128, top-2): the q/k norms keep the TP-gathered heads, 2(q + kv)
    = 2 x (64 + 32) bytes a token whatever the TP size; Qwen3's per-head norms split that over TP."""
    cfg = {**SMALL, "model_type": "minimax_m2", "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
           "rotary_dim": 8, "use_qk_norm": True}
    shape = model_shape(cfg)
    # norms 512, q/k/v 256, attention out 128, lse 16, q/k norm inputs 192, top-2 experts' SwiGLU 8*2*128 = 2048,
    # router logits 4*4 = 16
    assert activation_bytes_per_token(shape, TrainerLayout()) == 512 + 256 + 128 + 16 + 192 + 2048 + 16
    assert activation_bytes_per_token(shape, TrainerLayout(tp=2)) == 512 + 192 + 16 + (256 + 128 + 16 + 2048) / 2
    per_head = model_shape({**cfg, "model_type": "qwen3_moe", "moe_intermediate_size": 128})
    assert activation_bytes_per_token(per_head, TrainerLayout(tp=2)) == 512 + 16 + (256 + 128 + 16 + 192 + 2048) / 2


def test_mtp_layers_on_the_last_stage():
    """--mtp-num-layers 1 on GLM-4.7-Flash: the one GPU's parameters grow by one MoE decoder layer as transformers
    builds it (counted on the meta device) plus the MTP layer's own eh_proj [h, 2h] and three norms."""
    from transformers import AutoModelForCausalLM

    from slime_rl.config.families import transformers_config

    cfg = hf_config("glm4_7_flash.json")
    shape, h = model_shape(cfg), cfg["hidden_size"]
    with torch.device("meta"):  # one dense layer and one MoE layer: layer 1 is an MTP layer's decoder layer
        model = AutoModelForCausalLM.from_config(transformers_config({**cfg, "num_hidden_layers": 2,
                                                                      "mlp_layer_types": ["dense", "sparse"]}))
    moe_layer = sum(p.numel() for p in model.model.layers[1].parameters())
    grown = estimate_memory(shape, TrainerLayout(mtp_layers=1)).params - estimate_memory(shape, TrainerLayout()).params
    assert grown == moe_layer + 2 * h * h + 3 * h
