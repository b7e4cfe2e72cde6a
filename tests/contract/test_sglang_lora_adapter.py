"""--lora-sync adapter against SGLang 0.5.23's own code: the launch flags its ServerArgs parser reads, the
serialized_named_tensors entry its TP worker decodes (made in a process where megatron-core replaced
torch's storage loader, as in a trainer rank), the adapter_config its LoRAConfig and target-module
normalization take, and the tensors its LoRAAdapter stacks into the fused qkv_proj / gate_up_proj it serves:
each q/k/v/gate/up part of the stack is exactly the adapter we sent for that linear."""

from __future__ import annotations

import json

import pytest
import torch

from slime_rl.engines.payloads import load_lora_adapter_from_tensors_payload
from slime_rl.engines.tensor_ipc import serialize_by_value
from slime_rl.orchestration.engines import engine_command
from slime_rl.orchestration.placement import plan_placement
from slime_rl.trainer.convert.lora_targets import LoRASpec, peft_key, sglang_adapter_config
from tests.contract.test_rollout_server_args import _cfg, _sglang_parse

pytest.importorskip("sglang.srt.lora.lora",
                    reason="sglang 0.5.23 is not importable here (pip install --no-deps sglang)")

LINEARS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def _adapter(hf: dict, rank: int, modules: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """PEFT-named A [r, in] and B [out, r] for every linear of the tiny model named in `modules`."""
    h, inter = hf["hidden_size"], hf["intermediate_size"]
    hd = hf.get("head_dim") or h // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # (in, out)
    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in range(hf["num_hidden_layers"]):
        for block, names in LINEARS.items():
            for name in names:
                if name not in modules:
                    continue
                module = f"model.layers.{layer}.{block}.{name}"
                n_in, n_out = shapes[name]
                out[peft_key(module, "A")] = torch.randn(rank, n_in, generator=g)
                out[peft_key(module, "B")] = torch.randn(n_out, rank, generator=g)
    return out


@pytest.mark.parametrize("targets", [("all-linear",), ("q_proj", "v_proj", "o_proj", "down_proj")])
def test_sglang_takes_the_adapters_as_sent(tiny_qwen2, tmp_path, targets):
    import megatron.core  # noqa: F401  (replaces torch.storage._load_from_bytes, as in a trainer rank)
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.lora.lora_config import LoRAConfig
    from sglang.srt.lora.utils import get_normalized_target_modules
    from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput
    from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payloads
    from transformers import AutoConfig

    # the launch: SGLang's parser reads what engine_command passes
    cfg = _cfg(tiny_qwen2, tmp_path, "--rollout-backend", "sglang", "--lora-rank", "4", "--lora-sync", "adapter",
               "--lora-target-modules", *targets)
    plan = plan_placement(cfg.parallel, cfg.engine, cluster_gpus=2)
    ns = _sglang_parse(engine_command(cfg, plan.engines[0], "h", 30000, None, use_gpu=True))
    assert ns.enable_lora is True and int(ns.max_lora_rank) == 4
    assert ns.lora_target_modules == (["all"] if targets == ("all-linear",) else sorted(targets))

    hf = json.loads((tiny_qwen2 / "config.json").read_text())
    modules = sum(LINEARS.values(), ()) if targets == ("all-linear",) else targets
    sent = _adapter(hf, 4, modules)
    config = sglang_adapter_config(LoRASpec(4, 8.0), {k.removeprefix("base_model.model.").split(".lora_")[0]
                                                      for k in sent}, str(tiny_qwen2))
    body = load_lora_adapter_from_tensors_payload("policy_v1", config, [serialize_by_value(sent)] * 2)
    req = LoadLoRAAdapterFromTensorsReqInput(**body)  # SGLang's own request struct

    # each TP rank decodes its own entry (srt/managers/tp_worker.py deserialize_own_rank; its
    # monkey_patch_torch_reductions concerns CUDA handles, which a by-value entry has none of, and would stay
    # patched in this process for the other tests)
    entries = normalize_serialized_named_tensor_payloads(req.serialized_named_tensors)
    got = MultiprocessingSerializer.deserialize(entries[1])
    assert set(got) == set(sent) and all(torch.equal(got[k], sent[k]) for k in sent)

    # the config: a LoRA SGLang accepts, whose modules the server's --lora-target-modules cover
    lora_config = LoRAConfig.from_dict(req.config_dict)
    assert (lora_config.r, lora_config.lora_alpha) == (4, 8.0)
    served = get_normalized_target_modules(ns.lora_target_modules)
    assert served == {"all"} or get_normalized_target_modules(lora_config.target_modules) <= served

    # SGLang's adapter: q/k/v stacked into qkv_proj (a missing k_proj as zeros), gate/up into gate_up_proj
    adapter = LoRAAdapter("uid", lora_config, AutoConfig.from_pretrained(str(tiny_qwen2)), LoadConfig(), None)
    adapter.initialize_weights_from_tensors(got)
    r = 4
    for layer in range(hf["num_hidden_layers"]):
        w = adapter.layers[layer].weights
        pre = f"base_model.model.model.layers.{layer}"

        def ours(name: str, which: str, block: str, pre: str = pre) -> torch.Tensor | None:
            return sent.get(peft_key(f"{pre.removeprefix('base_model.model.')}.{block}.{name}", which))

        qkv_a, qkv_b = w[f"{pre}.self_attn.qkv_proj.lora_A.weight"], w[f"{pre}.self_attn.qkv_proj.lora_B.weight"]
        rows = 0
        for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
            a, b = ours(name, "A", "self_attn"), ours(name, "B", "self_attn")
            if a is None:  # not adapted: SGLang's zeros
                assert name == "k_proj" and not qkv_a[i * r:(i + 1) * r].any()
                kv_rows = ours("v_proj", "B", "self_attn").shape[0]
                assert not qkv_b[rows:rows + kv_rows].any()
                rows += kv_rows
                continue
            assert torch.equal(qkv_a[i * r:(i + 1) * r], a)
            assert torch.equal(qkv_b[rows:rows + b.shape[0]], b)
            rows += b.shape[0]
        assert rows == qkv_b.shape[0]
        for name, block in (("o_proj", "self_attn"), ("down_proj", "mlp")):
            for which in ("A", "B"):
                assert torch.equal(w[f"{pre}.{block}.{name}.lora_{which}.weight"], ours(name, which, block))
        if "gate_proj" in modules:
            gu_a, gu_b = w[f"{pre}.mlp.gate_up_proj.lora_A.weight"], w[f"{pre}.mlp.gate_up_proj.lora_B.weight"]
            assert torch.equal(gu_a, torch.cat([ours("gate_proj", "A", "mlp"), ours("up_proj", "A", "mlp")]))
            assert torch.equal(gu_b, torch.cat([ours("gate_proj", "B", "mlp"), ours("up_proj", "B", "mlp")]))
        expected = {"qkv_proj", "o_proj", "down_proj"} | ({"gate_up_proj"} if "gate_proj" in modules else set())
        assert {k.rsplit(".", 3)[-3] for k in w} == expected
