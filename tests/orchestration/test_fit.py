"""`--dry-run --cluster NODESxGPUS:GPU`: fits / does not fit per trainer GPU and engine GPU
(orchestration/fit.py), for real models' published config.json values (Qwen3-4B, Qwen3-30B-A3B,
Qwen3-235B-A22B, Qwen2.5-7B, Qwen2.5-32B) in slime's and verl's usual layouts.

The expected verdicts come from an independent calculation written here (parameters per GPU from the
config's sizes, Megatron's distributed-optimizer bytes, the saved tensors of one layer listed by
hand), not from the code under test: the code's trainer figure must be within 1.25x of it, and only
layouts whose verdict that calculation decides with a 1.25x margin either way are asserted."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from slime_rl.config.gpus import GPU_MIB, parse_gpu
from slime_rl.orchestration import fit
from slime_rl.orchestration.estimate import model_shape
from slime_rl.orchestration.fit import kv_bytes_per_token, sglang_default_fraction
from slime_rl.train import main as train_main

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
MIGRATION = HERE.parents[0] / "migration" / "hf_configs"
CONFIG_FILES = {
    "qwen3_4b": HERE / "hf_configs" / "qwen3_4b.json",
    "qwen3_30b_a3b": HERE / "hf_configs" / "qwen3_30b_a3b.json",
    "qwen3_235b_a22b": MIGRATION / "Qwen3-235B-A22B" / "config.json",
    "qwen2_5_7b": HERE / "hf_configs" / "qwen2_5_7b_instruct.json",
    "qwen2_5_32b": HERE / "hf_configs" / "qwen2_5_32b.json",
}
GiB = 2**30


def independent_trainer_gib(c: dict, tp: int, pp: int, dp: int, ep: int, etp: int, tokens: int,
                            recompute: bool) -> float:
    """Bytes on the busiest trainer GPU, counted another way than estimate.py: every weight matrix of the
    config, bf16 weights (2) + fp32 grads (4) + Adam's fp32 master, m, v (12) sharded over the
    data-parallel ranks (experts: over the expert-data-parallel ranks), and per layer and token the
    tensors autograd keeps: both norms' inputs, the qkv/fc1 inputs, q, k, v, Qwen3's q/k norm inputs, the
    attention output, gate, up, silu(gate) and their product (eager SwiGLU), all bf16 over TP with
    sequence parallel; fp32 logits and their gradient (8 bytes per token x vocab / TP) at the last stage."""
    h, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    a, kvh = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or h // a
    q, kv = a * hd, kvh * hd
    attention = h * q + 2 * h * kv + q * h
    experts = c.get("num_experts", 0)
    if experts:
        fe, k = c["moe_intermediate_size"], c["num_experts_per_tok"]
        dense_per_layer, expert_per_layer, ffn_tokens = attention + h * experts, experts * 3 * h * fe, k * fe
    else:
        dense_per_layer, expert_per_layer, ffn_tokens = attention + 3 * h * c["intermediate_size"], 0, \
            c["intermediate_size"]
    layers = L // pp
    embed = V * h * (1 if c.get("tie_word_embeddings") and pp == 1 else 2 if pp == 1 else 1)
    dense = (layers * dense_per_layer + embed) / tp
    expert = layers * expert_per_layer / (ep * etp)
    world = tp * pp * dp
    expert_dp = world // (pp * ep * etp)
    static = dense * (2 + 4 + 12 / dp) + expert * (2 + 4 + 12 / expert_dp)
    qk_norm = 2 * (q + kv) if c["model_type"].startswith("qwen3") else 0
    per_layer_token = (2 * h + 2 * h + 2 * h + 2 * h) / tp + (2 * (q + 2 * kv) + qk_norm + 2 * q
                                                               + 4 * 2 * ffn_tokens) / tp
    layer_bytes = per_layer_token * tokens
    activations = (layers * 2 * h * tokens / tp + layer_bytes) if recompute else layers * layer_bytes
    logits = 8 * tokens * V / tp
    return (static + activations + logits) / GiB


def config_only(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(CONFIG_FILES[name], folder / "config.json")
    return folder


BASE = ["--prompt-data", "/data/not-here.jsonl", "--rollout-backend", "sglang", "--rm-type", "math", "--bf16",
        "--num-rollout", "10", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--global-batch-size",
        "256", "--rollout-max-prompt-len", "1024", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192",
        "--dry-run"]

# name, model, --cluster, flags, (tp, pp, dp, ep, etp), tokens per micro-batch, recompute, response length
LAYOUTS = [
    # slime's scripts/run-qwen3-235B-A22B.sh shape on a single 8-GPU node: far too big
    ("235b-1x8-h100", "qwen3_235b_a22b", "1x8:H100",
     ["--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "4", "--sequence-parallel",
      "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1", "--colocate",
      "--rollout-num-gpus-per-engine", "8", "--max-tokens-per-gpu", "9216"], (4, 1, 2, 8, 1), 9216, False, 8192),
    # slime's scripts/run-qwen3-30B-A3B.sh layout (TP 4, EP 8, colocated, 8 GPUs), full recompute
    ("30b-a3b-1x8-h200-colocated", "qwen3_30b_a3b", "1x8:H200",
     ["--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "4", "--sequence-parallel",
      "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1", "--colocate",
      "--rollout-num-gpus-per-engine", "8", "--max-tokens-per-gpu", "20480", "--recompute-granularity", "full",
      "--recompute-method", "uniform", "--recompute-num-layers", "1"], (4, 1, 2, 8, 1), 20480, True, 8192),
    # the same on 40 GiB A100s: the experts' optimizer state alone is over
    ("30b-a3b-1x8-a100-40-colocated", "qwen3_30b_a3b", "1x8:A100-40",
     ["--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "4", "--sequence-parallel",
      "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1", "--colocate",
      "--rollout-num-gpus-per-engine", "8", "--max-tokens-per-gpu", "20480", "--recompute-granularity", "full",
      "--recompute-method", "uniform", "--recompute-num-layers", "1"], (4, 1, 2, 8, 1), 20480, True, 8192),
    # slime's scripts/run-qwen3-4B.sh: 4 trainer GPUs + 4 engines, recompute, 9216-token micro-batches
    ("4b-4+4-h100", "qwen3_4b", "1x8:H100",
     ["--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4", "--max-tokens-per-gpu", "9216",
      "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
     (1, 1, 4, 1, 1), 9216, True, 8192),
    # the same without recompute and with 32k-token micro-batches: the activations do not fit
    ("4b-4+4-h100-no-recompute", "qwen3_4b", "1x8:H100",
     ["--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4", "--max-tokens-per-gpu", "32768"],
     (1, 1, 4, 1, 1), 32768, False, 8192),
    # verl's Qwen2.5-7B GRPO example shape: 8 GPUs, TP 2 colocated engines, micro-batches of 16k tokens
    ("7b-1x8-h100-colocated", "qwen2_5_7b", "1x8:H100",
     ["--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--colocate",
      "--rollout-num-gpus-per-engine", "2", "--max-tokens-per-gpu", "16384", "--recompute-granularity", "full",
      "--recompute-method", "uniform", "--recompute-num-layers", "1"], (2, 1, 4, 1, 1), 16384, True, 4096),
    # Qwen2.5-32B on four nodes: 16 trainer GPUs TP 8 x DP 2, 16 engine GPUs TP 4
    ("32b-4x8-h100", "qwen2_5_32b", "4x8:H100",
     ["--actor-num-nodes", "2", "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "8",
      "--sequence-parallel", "--rollout-num-gpus", "16", "--rollout-num-gpus-per-engine", "4", "--max-tokens-per-gpu",
      "8192", "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
     (8, 1, 2, 1, 1), 8192, True, 4096),
    # Qwen2.5-32B trained on one node at TP 2: the weights, gradients and optimizer do not fit
    ("32b-1x8-h100-tp2", "qwen2_5_32b", "1x8:H100",
     ["--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel",
      "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "4", "--max-tokens-per-gpu", "8192",
      "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
     (2, 1, 2, 1, 1), 8192, True, 4096),
]


def run_plan(tmp_path: Path, model: str, cluster: str, flags: list[str], response: int, capsys) -> tuple[int, str]:
    hf = config_only(tmp_path, model)
    code = train_main(["--hf-checkpoint", str(hf), *BASE, "--rollout-max-response-len", str(response),
                       "--cluster", cluster, *flags])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("name, model, cluster, flags, layout, tokens, recompute, response", LAYOUTS,
                         ids=[lay[0] for lay in LAYOUTS])
def test_trainer_verdict_agrees_with_an_independent_count(name, model, cluster, flags, layout, tokens, recompute,
                                                          response, tmp_path, capsys):
    code, out = run_plan(tmp_path, model, cluster, flags, response, capsys)
    assert "error: --" not in out, out  # planned, not refused by a check
    expected = independent_trainer_gib(json.loads(CONFIG_FILES[model].read_text()), *layout, tokens, recompute)
    total = float(re.search(r"^  total +(\d+\.\d\d) GiB", out, flags=re.MULTILINE).group(1))
    assert 1 / 1.25 <= total / expected <= 1.25, (total, expected)
    gpu = parse_gpu(cluster.split(":")[1]).gib
    verdict = re.search(r"^trainer GPU: needs (\d+\.\d\d) GiB of .* -> (fits|DOES NOT FIT)", out, flags=re.MULTILINE)
    assert verdict, out
    if expected * 1.25 < gpu:
        assert verdict.group(2) == "fits", out
    elif expected / 1.25 > gpu:
        assert verdict.group(2) == "DOES NOT FIT", out
        assert code == 1 and "the plan does not fit its GPUs" in out
        assert re.search(r"DOES NOT FIT \(\d+\.\d\d GiB over\); the largest term: (weights|grads|optimizer|"
                         r"activations|logits) \d+\.\d\d GiB", out)
    else:
        pytest.fail(f"{name}: the independent count ({expected:.1f} GiB) does not decide on {gpu:.1f} GiB")


def test_a_change_that_fits_is_named(tmp_path, capsys):
    """Qwen3-4B without recompute in 32k-token micro-batches on an H100: the activations are the largest
    term; full recompute with TP 2 (sequence parallel) brings it under the GPU's memory with the
    allocator's reserve and the memory outside torch counted (the independent count of that layout, with
    the reserve measured on an H100, says so too)."""
    code, out = run_plan(tmp_path, "qwen3_4b", "1x8:H100", LAYOUTS[4][3], 8192, capsys)
    assert code == 1
    assert "the largest term: activations" in out
    fix = re.search(r"fits with --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
                    r"and --tensor-model-parallel-size 2 --sequence-parallel: (\d+\.\d\d) GiB", out)
    assert fix, out
    assert float(fix.group(1)) < GPU_MIB["H100"] / 1024
    config = json.loads(CONFIG_FILES["qwen3_4b"].read_text())
    reserve, outside = measured_reserve()
    assert independent_trainer_gib(config, 2, 1, 2, 1, 1, 32768, True) * reserve + outside < GPU_MIB["H100"] / 1024
    # and recompute alone at TP 1 does not fit, by the independent count too
    assert independent_trainer_gib(config, 1, 1, 4, 1, 1, 32768, True) * reserve + outside > GPU_MIB["H100"] / 1024


def measured_reserve() -> tuple[float, float]:
    """From bench/train_memory.py's runs on an H100: the largest reserved peak / estimate and the most
    memory outside torch's allocator."""
    rows = [json.loads(line) for line in (ROOT / "bench/results/train_memory_reserve_1xH100_2026-12-05.jsonl")
            .read_text().splitlines() if line.strip()]
    done = [r for r in rows if r["measured_reserved_peak_gib"] == r["measured_reserved_peak_gib"]]  # not NaN
    assert len(done) >= 5
    return (max(r["measured_reserved_peak_gib"] / r["estimate_gib"] for r in done),
            max(r["non_torch_gib"] for r in done))


def test_fit_counts_at_least_the_measured_reserve():
    """A verdict adds to the estimate at least what the H100 runs measured above it: the allocator's
    reserved peak over the estimate, and the memory the process holds outside torch's allocator."""
    reserve, outside = measured_reserve()
    assert 1.0 < reserve <= fit.TRAINER_RESERVE < reserve + 0.05
    assert 0.5 < outside <= fit.NON_TORCH_GIB < outside + 0.5


def test_engine_kv_cache_by_hand(tmp_path, capsys):
    """Qwen3-4B engines of TP 1 on H100s (no --sglang-mem-fraction-static): SGLang 0.5.23's rule gives
    reserved = 512 + 1.5 x 8192 + 1 / 8 x 1024 + 2 x 256 = 13,440 MiB of 81,559, so 0.835 of the GPU is the
    static pool; the KV cache is that less 4,022,468,096 bf16 weights, at 2 x 36 layers x 8 KV heads x
    128 x 2 bytes = 147,456 bytes a token."""
    code, out = run_plan(tmp_path, "qwen3_4b", "1x8:H100", LAYOUTS[3][3], 8192, capsys)
    assert code == 0, out
    pool = 0.835 * 81559 / 1024
    kv = pool - 4_022_468_096 * 2 / GiB
    tokens = int(kv * GiB // 147_456)
    assert f"KV cache {kv:.2f} GiB = {tokens:,} tokens (144.0 KiB per token) -> fits: {tokens // 9216:,} samples " \
           "of 9,216 tokens at once" in out, out


def test_engine_without_room_for_its_weights_is_named(tmp_path, capsys):
    """Qwen2.5-32B engines of TP 1 on 40 GiB A100s: 65.5 GB of bf16 weights alone exceed the GPU."""
    code, out = run_plan(tmp_path, "qwen2_5_32b", "2x8:A100-40",
                         ["--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "8", "--sequence-parallel",
                          "--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "1", "--max-tokens-per-gpu",
                          "8192", "--recompute-granularity", "full", "--recompute-method", "uniform",
                          "--recompute-num-layers", "1"], 4096, capsys)
    assert code == 1
    assert re.search(r"^engine GPU: .*DOES NOT FIT: no room for a KV cache; raise --rollout-num-gpus-per-engine",
                     out, flags=re.MULTILINE), out


def test_sglang_default_fraction_by_hand():
    # B200 (183,359 MiB), TP 8: 512 + 1.5 x 16384 + 8 / 8 x 1024 + 2 x 512 = 27,136 MiB reserved
    assert sglang_default_fraction(parse_gpu("B200"), tp=8) == round((183359 - 27136) / 183359, 3)
    # A100-40 (40,960 MiB), TP 1: 512 + 1.5 x 4096 + 128 + 2 x 32 = 6,848; no 10 GiB floor under 60 GiB
    assert sglang_default_fraction(parse_gpu("a100-40"), tp=1) == round((40960 - 6848) / 40960, 3)
    # H200, TP 1, graphs off: 512 + 12288 + 128 = 12,928 MiB, above the 10 GiB floor
    assert sglang_default_fraction(parse_gpu("H200"), tp=1, cuda_graph=False) == round((143771 - 12928) / 143771, 3)


def test_kv_heads_are_replicated_beyond_their_count():
    shape = model_shape(json.loads(CONFIG_FILES["qwen2_5_7b"].read_text()))  # 4 KV heads of 128, 28 layers
    assert kv_bytes_per_token(shape, tp=2, dtype_bytes=2) == 2 * 28 * 2 * 128 * 2
    assert kv_bytes_per_token(shape, tp=8, dtype_bytes=2) == 2 * 28 * 1 * 128 * 2  # one head per rank


@pytest.mark.parametrize("value, gib", [("H100", 81559 / 1024), ("h200", 143771 / 1024), ("80", 80.0),
                                        ("141GB", 141.0), ("96gib", 96.0)])
def test_gpu_names_and_sizes(value, gib):
    assert parse_gpu(value).gib == pytest.approx(gib)


@pytest.mark.parametrize("value", ["1x8:V100X", "1x8:0", "1x8:", "2x8:-5"])
def test_bad_gpu_names_the_flag(value, tmp_path, capsys):
    code, out = run_plan(tmp_path, "qwen3_4b", value, [], 1024, capsys)
    if value == "1x8:":  # an empty GPU: no verdict, as without ':'
        assert code == 0 and "fit: not judged" in out
        return
    assert code == 2 and "--cluster" in out and "GPU" in out, out


def test_no_gpu_named_no_verdict(tmp_path, capsys):
    code, out = run_plan(tmp_path, "qwen2_5_32b", "1x8", LAYOUTS[7][3], 4096, capsys)
    assert code == 0
    assert "fit: not judged (no GPU named): --cluster NODESxGPUS:GPU" in out and "DOES NOT FIT" not in out


@pytest.mark.parametrize("model", ["DeepSeek-R1"])
def test_unsupported_family_one_sentence_nonzero(model, tmp_path, capsys):
    """A family not built here (DeepSeek-V3.2-Exp's deepseek_v32 on DeepSeek-R1's sizes: every family of slime's
    scripts is built now) is one sentence and exit 2, whatever the other flags."""
    hf = tmp_path / model
    hf.mkdir()
    cfg = json.loads((MIGRATION / model / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "model_type": "deepseek_v32"}))
    code = train_main(["--hf-checkpoint", str(hf), *BASE, "--cluster", "8x8:H100", "--actor-num-nodes", "8",
                       "--actor-num-gpus-per-node", "8", "--expert-model-parallel-size", "16", "--colocate"])
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "which is not a model family this trainer builds" in lines[0], err
    assert "dense" not in err


@pytest.mark.parametrize("model,family,experts,moe_layers", [("DeepSeek-R1", "deepseek_v3", 256, 58),
                                                           ("GLM-4.7", "glm4_moe", 160, 89)])
def test_flagship_moe_at_ep16_does_not_fit_64_h100s_and_says_what_would(model, family, experts, moe_layers, tmp_path,
                                                                        capsys):
    """slime's flagship models (DeepSeek-R1: 671 B, GLM-4.7: 355 B) colocated on 8 x 8 H100 with only EP 16 and
    TP 1: the planner says the trainer GPU does not fit (exit 1), names its largest term and the closest changes,
    and the engine GPU does not fit beside the trainer's resident state. The model line comes from config.json
    (layers less first_k_dense_replace are MoE layers)."""
    hf = tmp_path / model
    hf.mkdir()
    shutil.copy(MIGRATION / model / "config.json", hf / "config.json")
    code = train_main(["--hf-checkpoint", str(hf), *BASE, "--cluster", "8x8:H100", "--actor-num-nodes", "8",
                       "--actor-num-gpus-per-node", "8", "--expert-model-parallel-size", "16", "--colocate"])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    out = captured.out
    assert f"{family}, " in out and f"{experts} experts, top-8, in {moe_layers} layers" in out, out
    assert re.search(r"trainer GPU: needs [\d.]+ GiB of 79\.65 \(H100\).*DOES NOT FIT.*the largest term: \w+", out)
    assert "no change of one or two flags fits: closest --" in out
    assert "engine GPU: DOES NOT FIT" in out
    assert "the plan does not fit its GPUs" in captured.err


def test_uneven_pipeline_split_is_refused(tmp_path, capsys):
    """Qwen3-235B's 94 layers do not split over 4 pipeline stages."""
    hf = config_only(tmp_path, "qwen3_235b_a22b")
    code = train_main(["--hf-checkpoint", str(hf), *BASE, "--cluster", "4x8:H100", "--actor-num-nodes", "4",
                       "--actor-num-gpus-per-node", "8", "--pipeline-model-parallel-size", "4",
                       "--tensor-model-parallel-size", "4", "--sequence-parallel", "--expert-model-parallel-size", "8",
                       "--expert-tensor-parallel-size", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--pipeline-model-parallel-size 4" in err and "94 layers" in err
