"""--lora-* flags: what the config takes, and the sentences that refuse the rest before any process starts
(the adapters' math: tests/trainer/test_lora.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from slime_rl.config import ConfigError, build_config
from slime_rl.config.checks import ConfigNote
from slime_rl.train import check_model_features


def _cfg(model, *extra: str):
    data = Path(model) / "prompts.jsonl"  # never read here
    data.write_text('{"problem": "1", "answer": "1"}\n')
    return build_config(["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rollout-batch-size", "4",
                         "--global-batch-size", "4", "--num-rollout", "1", "--rm-type", "digit", *extra])


def _adapter(folder: Path, modules: list[str], r: int = 4, alpha: float = 16.0, **cfg) -> Path:
    """A PEFT folder as PEFT writes one (hand-made: config keys and tensor names from PEFT's docs)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": alpha,
                                                           "target_modules": ["q_proj"], **cfg}))
    tensors = {f"base_model.model.{m}.lora_{w}.weight": torch.zeros(r, 4) for m in modules for w in "AB"}
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.mark.parametrize("targets, want", [
    (["q_proj,v_proj"], ("q_proj", "v_proj")),
    (["q_proj", "v_proj", "o_proj"], ("q_proj", "v_proj", "o_proj")),
    ([], ("all-linear",)),
])
def test_targets_are_taken_as_peft_users_write_them(tiny_qwen2, targets, want):
    extra = ["--lora-target-modules", *targets] if targets else []
    cfg = _cfg(tiny_qwen2, "--lora-rank", "8", "--lora-alpha", "16", *extra)
    assert (cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_target_modules) == (8, 16.0, want)
    check_model_features(cfg)


@pytest.mark.parametrize("extra, message", [
    (["--lora-alpha", "16"], "--lora-alpha set LoRA's adapters, which are on only with --lora-rank"),
    (["--lora-target-modules", "q_proj"], "--lora-target-modules set LoRA's adapters"),
    (["--lora-rank", "8", "--lora-dropout", "1"], "--lora-dropout must be in \\[0, 1\\)"),
])
def test_flags_alone_are_refused_naming_the_flag(tiny_qwen2, extra, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(tiny_qwen2, *extra)


def test_targets_are_checked_against_the_model(tiny_qwen2, tiny_qwen3_moe, tiny_deepseek_v3, tiny_qwen2_5_vl):
    with pytest.raises(ConfigError, match="--lora-target-modules qkv_proj: no linear of this model is named so "
                                          "\\(its linears: .*q_proj"):
        check_model_features(_cfg(tiny_qwen2, "--lora-rank", "8", "--lora-target-modules", "qkv_proj"))
    with pytest.raises(ConfigError, match="--lora-target-modules gate_proj: only the routed experts have it"):
        check_model_features(_cfg(tiny_qwen3_moe, "--lora-rank", "8", "--lora-target-modules", "gate_proj"))
    with pytest.warns(ConfigNote, match="routed experts train neither"):
        check_model_features(_cfg(tiny_qwen3_moe, "--lora-rank", "8"))
    for model, what in ((tiny_deepseek_v3, "multi-latent attention"), (tiny_qwen2_5_vl, "vision-language")):
        with pytest.raises(ConfigError, match=f"--lora-rank: LoRA on {what}"):
            check_model_features(_cfg(model, "--lora-rank", "8"))


def test_lora_load_sets_the_adapters_and_must_agree_with_the_flags(tiny_qwen2, tmp_path):
    folder = _adapter(tmp_path / "a", ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj"])
    check_model_features(_cfg(tiny_qwen2, "--lora-load", str(folder)))
    check_model_features(_cfg(tiny_qwen2, "--lora-load", str(folder), "--lora-rank", "4"))  # agrees
    with pytest.raises(ConfigError, match="--lora-rank 8 disagrees with --lora-load .*r.*: 4"):
        check_model_features(_cfg(tiny_qwen2, "--lora-load", str(folder), "--lora-rank", "8"))
    with pytest.raises(ConfigError, match="--lora-target-modules o_proj disagrees with --lora-load .* q_proj,v_proj"):
        check_model_features(_cfg(tiny_qwen2, "--lora-load", str(folder), "--lora-target-modules", "o_proj"))
    with pytest.raises(ConfigError, match="--lora-load .*/nowhere: no such folder"):
        check_model_features(_cfg(tiny_qwen2, "--lora-load", str(tmp_path / "nowhere")))
    with pytest.raises(ConfigError, match="--lora-load .*: no adapter_config.json"):
        check_model_features(_cfg(tiny_qwen2, "--lora-load", str(tmp_path)))
    dora = _adapter(tmp_path / "dora", ["model.layers.0.self_attn.q_proj"], use_dora=True)
    with pytest.raises(ConfigError, match="use_dora is True; only plain LoRA"):
        check_model_features(_cfg(tiny_qwen2, "--lora-load", str(dora)))


def test_a_pipeline_stage_may_hold_none_of_the_targets(tiny_qwen2_moe):
    """Qwen2-MoE's layer 1 is dense: gate_proj names its MLP and its MoE layers' shared expert (adapted) and the
    routed experts (not). One MoE layer alone (a stage's share) is selected without the whole model's checks."""
    from slime_rl.trainer.convert import load_arch
    from slime_rl.trainer.convert.lora_targets import choose

    arch = load_arch(tiny_qwen2_moe)
    every = [pm for i in range(arch.num_layers) for pm in arch.layer_maps(i)]
    chosen = choose(every, ("gate_proj",))
    assert sorted(chosen) == ["decoder.layers.{i}.mlp.linear_fc1.weight",
                              "decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight"]
    assert all(flags == (True, False) for flags in chosen.values())  # gate of [gate; up]
    attention_only = [pm for pm in arch.layer_maps(0) if "experts" not in pm.mcore and "mlp" not in pm.mcore]
    assert choose(attention_only, ("gate_proj",), check=False) == {}
    with pytest.raises(ValueError, match="--lora-target-modules gate_proj: no linear of this model"):
        choose(attention_only, ("gate_proj",))


def test_the_plan_counts_the_adapters_of_the_lora_load_folder(tiny_qwen2, tmp_path):
    """--dry-run with --lora-load: the estimate counts the folder's adapters (its r, the modules its tensors adapt),
    not the --lora-target-modules default (all-linear)."""
    from slime_rl.orchestration.estimate import model_shape, stage_lora_params
    from slime_rl.orchestration.plan_report import trainer_layout

    folder = _adapter(tmp_path / "a", ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj"])
    lay, _ = trainer_layout(_cfg(tiny_qwen2, "--lora-load", str(folder)))
    assert (lay.lora_rank, set(lay.lora_targets)) == (4, {"q_proj", "v_proj"})
    whole, _ = trainer_layout(_cfg(tiny_qwen2, "--lora-rank", "4"))
    assert whole.lora_targets == ("all-linear",)
    shape = model_shape(json.loads((tiny_qwen2 / "config.json").read_text()))
    hidden, heads, kv_heads = shape.hidden, shape.heads, shape.kv_heads
    head_dim = shape.head_dim
    # r x (in + out) per adapted linear, for q_proj and v_proj of each layer (the planner counts every layer)
    want = shape.layers * 4 * ((hidden + heads * head_dim) + (hidden + kv_heads * head_dim))
    assert stage_lora_params(shape, lay, 0) == want < stage_lora_params(shape, whole, 0)


@pytest.mark.parametrize("model, extra, message", [
    ("tiny_qwen2", ["--lora-sync", "adapter"], "no adapters to send without --lora-rank"),
    ("tiny_qwen2", ["--lora-rank", "4", "--lora-sync", "adapter", "--use-fault-tolerance"], "--use-fault-tolerance"),
    ("tiny_qwen2", ["--lora-rank", "4", "--lora-sync", "adapter", "--rollout-backend", "sglang",
                    "--lora-target-modules", "k_proj,o_proj"], "add q_proj and v_proj"),
    ("tiny_qwen2", ["--lora-rank", "4", "--lora-sync", "adapter", "--rollout-backend", "sglang",
                    "--lora-target-modules", "q_proj,v_proj,up_proj"], "add gate_proj"),
    ("tiny_qwen2_moe", ["--lora-rank", "4", "--lora-sync", "adapter", "--rollout-backend", "sglang"],
     "adapt the attention only"),
])
def test_adapter_sync_refuses_what_the_engines_cannot_take(model, extra, message, request):
    """--lora-sync adapter: SGLang stacks q/k/v from q_proj's and v_proj's adapters and gate/up from gate_proj's
    (tests/contract/test_sglang_lora_adapter.py); each refusal names the fix."""
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_model_features(_cfg(request.getfixturevalue(model), *extra))


def test_adapter_sync_takes_what_sglang_stacks(tiny_qwen2, tiny_qwen2_moe):
    for model, targets in ((tiny_qwen2, "q_proj,v_proj,down_proj"), (tiny_qwen2, "all-linear"),
                           (tiny_qwen2_moe, "q_proj,k_proj,v_proj,o_proj")):
        cfg = _cfg(model, "--lora-rank", "4", "--lora-sync", "adapter", "--rollout-backend", "sglang",
                   "--lora-target-modules", targets)
        check_model_features(cfg)
        assert cfg.model.lora_sync == "adapter"
    check_model_features(_cfg(tiny_qwen2, "--lora-rank", "4", "--lora-sync", "adapter",  # built-in: any linear
                              "--lora-target-modules", "k_proj"))
