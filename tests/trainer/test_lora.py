"""LoRA (--lora-rank) on the tiny Qwen2, every linear adapted, rank 4, alpha 8 (tests/trainer/lora_scenarios.py).

References, each independent of the trainer's adapter code: PEFT 0.2x's own LoraModel over transformers' model
in float64, loaded from the trainer's export (log-probs); the merged weights as W + alpha/r * B A in float64
from the HF checkpoint and the exported A, B; the number of trainable values from config.json's widths;
one rank for TP2, TP2 with sequence parallelism, PP2 and DP2 (log-probs, adapter gradients, the adapters
after an optimizer step); CP2 too."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import free_port
from tests.tools.test_convert_tools import run_tool
from tests.trainer.lora_scenarios import ALPHA, RANK
from tests.trainer.trainer_ref import hf_logprobs, hf_model, make_batch
from tests.trainer.trainer_scenarios import run_scenario

pytestmark = pytest.mark.slow
TOL = 1e-5  # fp32 trainer vs float64 HF (as the other log-prob checks)
LAYOUT_TOL = 1e-6  # fp32 layouts vs one fp32 rank: log-probs, gradients
# the adapters after one Adam step (lr 1e-3): Adam divides each gradient by its own magnitude, so values of
# ~1e-9 that differ by summation order move by different amounts (as test_trainer_megatron's ADAM_STEP_TOL)
ADAM_STEP_TOL = 5e-6


@pytest.fixture(scope="module")
def runs(tiny_qwen2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    ckpts = {"qwen2": tiny_qwen2, "out": str(tmp)}
    out = {"one": run_scenario("lora_one", 1, free_port(), tmp, ckpts)[0], "tmp": tmp, "hf": tiny_qwen2}
    for name in ("tp2", "pp2", "dp2"):
        out[name] = run_scenario(f"lora_{name}", 2, free_port(), tmp, ckpts)
    run_tool("convert_hf_to_megatron", ["--hf-checkpoint", str(tiny_qwen2), "--save", str(tmp / "base_mcore")])
    out["resume"] = run_scenario("lora_resume", 2, free_port(), tmp, {**ckpts, "base_mcore": tmp / "base_mcore"})
    return out


def _max_diff(a, b) -> float:
    return max(float((torch.as_tensor(x, dtype=torch.float64) - torch.as_tensor(y, dtype=torch.float64)).abs().max())
               for x, y in zip(a, b, strict=True))


def _dict_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def test_adapters_start_as_the_base_model_exactly(runs):
    one = runs["one"]
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(one["init/logp"], one["off/logp"],
                                                                                     strict=True))
    want = hf_logprobs(hf_model(runs["hf"]), make_batch())
    assert _max_diff(one["init/logp"], want) < TOL


def test_peft_loads_the_export_and_its_logprobs_equal_the_trainers(runs):
    from peft import PeftModel

    one = runs["one"]
    folder = runs["tmp"] / "adapter"
    assert one["export"] == str(folder)
    model = PeftModel.from_pretrained(hf_model(runs["hf"]), str(folder)).double().eval()
    adapted = [n for n, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    assert len(adapted) == len(one["state"]) // 2 == 2 * 7  # 2 layers x q, k, v, o, gate, up, down
    got = hf_logprobs(model, make_batch())
    assert _max_diff(one["logp"], got) < TOL
    # with the adapters off, PEFT's model is the base: the random B are what moved the log-probs
    with model.disable_adapter():
        assert _max_diff(one["off/logp"], hf_logprobs(model, make_batch())) < TOL
    assert _max_diff(one["logp"], one["off/logp"]) > 1e-2


def test_merged_weights_are_base_plus_scaled_product(runs):
    from safetensors.torch import load_file

    one = runs["one"]
    base = load_file(str(runs["hf"] / "model.safetensors"))
    state = one["state"]
    adapted = {k.removeprefix("base_model.model.").split(".lora_")[0] for k in state}
    assert set(one["merged"]) == set(base) - {"lm_head.weight"}  # tied: the embedding only
    for name, got in one["merged"].items():
        module = name.removesuffix(".weight")
        if module not in adapted:
            assert torch.equal(got, base[name]), name
            continue
        a = state[f"base_model.model.{module}.lora_A.weight"].double()
        b = state[f"base_model.model.{module}.lora_B.weight"].double()
        want = base[name].double() + (ALPHA / RANK) * b @ a
        assert float((got.double() - want).abs().max()) < LAYOUT_TOL, name


def test_only_the_adapters_train(runs):
    one = runs["one"]
    cfg = json.loads((runs["hf"] / "config.json").read_text())
    h, inter, heads, kv = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                            "num_key_value_heads"))
    d = cfg.get("head_dim") or h // heads
    shapes = [(h, heads * d), (h, kv * d), (h, kv * d), (heads * d, h), (h, inter), (h, inter), (inter, h)]
    assert one["trainable"] == cfg["num_hidden_layers"] * sum(RANK * (i + o) for i, o in shapes)
    assert one["frozen_in_optimizer"] == 0
    assert one["base_unchanged"]
    # the step moved the adapters, and the merged weights with them
    assert _dict_diff(one["state"], one["state_after"]) > 1e-4
    assert _dict_diff(one["merged"], one["merged_after"]) > 1e-4


def _layout_records(runs, name: str) -> list[dict]:
    if name in ("tp2", "tp2sp", "cp2"):
        return [{k.split("/", 1)[1]: v for k, v in r.items() if k.startswith(f"{name}/")} for r in runs["tp2"]]
    return runs[name]


@pytest.mark.parametrize("layout", ["tp2", "tp2sp", "cp2", "pp2", "dp2"])
def test_layout_equals_one_rank(runs, layout):
    one, recs = runs["one"], _layout_records(runs, layout)
    if layout == "dp2":  # each DP rank holds its shard's log-probs; gradients and adapters are the whole batch's
        logp = [lp for r in sorted(recs, key=lambda r: r["dp_rank"]) for lp in r["logp"]]
    else:
        logp = recs[-1]["logp"]  # the last stage computes them (and broadcasts them over its PP group)
    assert _max_diff(logp, one["logp"]) < LAYOUT_TOL
    stages = {k: v for r in recs for k, v in r["grads"].items()}  # PP: each stage its layers
    assert _dict_diff(stages, one["grads"]) < LAYOUT_TOL
    after = {k: v for r in recs for k, v in r["state_after"].items()}
    assert _dict_diff(after, one["state_after"]) < ADAM_STEP_TOL
    for key in ("train/loss", "train/grad_norm"):
        assert abs(recs[0]["metrics"][key] - one["metrics"][key]) < LAYOUT_TOL, key
    assert all(r["base_unchanged"] for r in recs)


def test_lora_load_starts_from_the_exported_adapters(runs):
    one = runs["one"]
    assert torch.equal(torch.as_tensor(one["loaded/logp"][0]), torch.as_tensor(one["logp"][0]))
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(one["loaded/logp"], one["logp"],
                                                                                     strict=True))
    spec = one["loaded/spec"]  # LoRASpec, as a dict in the record
    assert (spec["rank"], spec["alpha"], set(spec["targets"])) == (RANK, ALPHA, {"q_proj", "k_proj", "v_proj", "o_proj",
                                                                        "gate_proj", "up_proj", "down_proj"})


def test_resume_continues_bit_identically(runs):
    """TP2: saved after step 2 of 4, a new trainer resumed there runs steps 3-4 as the unbroken one did."""
    for rank in runs["resume"]:
        assert rank["extra"] == {"rollout_id": 1, "lora": {"r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0,
                                                           "target_modules": ["all-linear"]}}
        for unbroken, resumed in zip(rank["unbroken"][2:], rank["resumed"], strict=True):
            assert unbroken["metrics"] == resumed["metrics"]
            assert set(unbroken["state"]) == set(resumed["state"])
            assert all(torch.equal(unbroken["state"][k], resumed["state"][k]) for k in unbroken["state"])
        # the steps did move the adapters (the comparison is not of constants)
        assert _dict_diff(rank["unbroken"][1]["state"], rank["unbroken"][3]["state"]) > 1e-5


def test_converter_merges_a_lora_checkpoint(runs):
    """tools/convert_megatron_to_hf.py --merge-lora of the TP2 LoRA run's checkpoint (after step 4): the merged
    folder is base + alpha/r B A of the adapter folder it writes beside it, whose tensors are the trainer's."""
    from safetensors.torch import load_file

    root, tmp = runs["tmp"] / "resume", runs["tmp"]
    with pytest.raises(RuntimeError, match="add --merge-lora"):
        run_tool("convert_megatron_to_hf", ["--load", str(root), "--save", str(tmp / "merged_refused")])
    run_tool("convert_megatron_to_hf", ["--load", str(root), "--save", str(tmp / "merged"), "--merge-lora"])
    merged = load_file(str(tmp / "merged" / "model.safetensors"))
    adapter = load_file(str(tmp / "merged" / "lora_adapter" / "adapter_model.safetensors"))
    saved = runs["resume"][0]["unbroken"][1]["state"]  # the trainer's adapters when it saved (after step 2)
    assert set(adapter) == set(saved) and all(torch.equal(adapter[k], saved[k]) for k in saved)
    base = load_file(str(runs["hf"] / "model.safetensors"))
    for name, t in merged.items():
        module = name.removesuffix(".weight")
        key = f"base_model.model.{module}.lora_A.weight"
        if key not in adapter:
            assert torch.equal(t, base[name]), name
            continue
        a, b = adapter[key].double(), adapter[key.replace("lora_A", "lora_B")].double()
        want = base[name].double() + (ALPHA / RANK) * b @ a
        assert float((t.double() - want).abs().max()) < LAYOUT_TOL, name


def test_a_checkpoint_without_adapters_loads_the_base_and_keeps_the_adapters_start(runs):
    for rank in runs["resume"]:
        assert all(torch.equal(rank["fresh/state"][k], rank["base_ckpt/state"][k]) for k in rank["fresh/state"])
        assert _max_diff(rank["base_ckpt/logp"], rank["fresh/logp"]) == 0.0
        assert rank["base_ckpt/metrics"]["train/grad_norm"] > 0


def test_planner_counts_the_trainers_adapters(runs):
    """The --dry-run estimate's adapter count (orchestration/estimate.py, from config.json) is the trainer's own
    count of trainable parameters, on one rank and on each of two TP ranks."""
    from slime_rl.orchestration.estimate import TrainerLayout, model_shape, stage_lora_params

    shape = model_shape(json.loads((runs["hf"] / "config.json").read_text()))
    assert stage_lora_params(shape, TrainerLayout(lora_rank=RANK), 0) == runs["one"]["trainable"]
    for rank in runs["tp2"]:
        assert stage_lora_params(shape, TrainerLayout(lora_rank=RANK, tp=2), 0) == rank["tp2/trainable"]


def test_dropout_is_in_the_training_forward_only(runs):
    one = runs["one"]
    assert all(torch.equal(torch.as_tensor(a), torch.as_tensor(b)) for a, b in zip(one["dropout/logp"], one["logp"],
                                                                                     strict=True))
    assert _dict_diff(one["dropout/grads"], one["grads"]) > 1e-3  # the masks changed the training forward
