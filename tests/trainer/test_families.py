"""The family records (slime_rl/config/families.py) against what the other rooms and tools assume:
each family has a tiny checkpoint for the tests, each named HF RMSNorm class exists in transformers
and computes the stock forward (what the engine's compiled piece replaces it with), and the engine's
MoE set is the families marked moe."""

import importlib

import pytest
import torch

from slime_rl.config.families import FAMILIES, get_family
from tools.make_tiny_model import ARCHS


def test_every_family_has_a_tiny_checkpoint_and_back():
    assert set(ARCHS) <= set(FAMILIES)
    # qwen3 is covered through qwen3_moe's tiny checkpoint (dense layers and q/k-norm)
    assert set(FAMILIES) - set(ARCHS) <= {"qwen3"}


def test_unknown_family_names_where_to_add_it():
    with pytest.raises(ValueError, match=r"config/families\.py.*make_tiny_model\.py"):
        get_family("no_such_model")


@pytest.mark.parametrize("model_type", sorted(t for t, f in FAMILIES.items() if f.hf_rmsnorm))
def test_named_rmsnorm_is_the_stock_forward(model_type):
    cls_name = FAMILIES[model_type].hf_rmsnorm
    runs_as = FAMILIES[model_type].transformers_model_type or model_type  # Kimi-K2: DeepSeek-V3's classes
    module = importlib.import_module(f"transformers.models.{runs_as}.modeling_{runs_as}")
    norm = getattr(module, cls_name)(64, eps=1e-6).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64, generator=gen))
        x = (3 * torch.randn(5, 64, generator=gen)).to(torch.bfloat16)
        h = x.double()
        want = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        torch.testing.assert_close(norm(x), want, atol=0, rtol=2**-7)  # one bf16 rounding of the product


def test_engine_moe_types_are_the_moe_families():
    from slime_rl.engines.embedded.experts import MOE_MODEL_TYPES

    assert set(MOE_MODEL_TYPES) == {"qwen3_moe", "qwen2_moe", "glm4_moe", "deepseek_v3", "kimi_k2",  # MoE families
                                    "glm4_moe_lite", "glm_moe_dsa", "minimax_m2", "qwen3_next", "qwen3_5_moe"}
    assert set(MOE_MODEL_TYPES) == {t for t, f in FAMILIES.items() if f.moe}
