"""GLM-4 dense (glm4) in the built-in engine: transformers' Glm4ForCausalLM runs as loaded (AutoModelForCausalLM),
and every checkpoint name a weight update sends, the post norms and the fused gate_up_proj among them, reaches the
tensor the model computes with. The engine's log-probs against a float64 forward, on the dynamic and the static
(CUDA-graph) paths: test_embedded_static_families.py."""

from __future__ import annotations

import pytest
import torch
from engine_testlib import assert_served_and_live

from slime_rl.config.families import FAMILIES


@pytest.mark.parametrize("name", ["model.layers.1.post_self_attn_layernorm.weight",
                                  "model.layers.0.post_mlp_layernorm.weight", "model.layers.1.mlp.gate_up_proj.weight"])
def test_every_checkpoint_name_is_served(tiny_glm4, name):
    def scale(t):
        t.mul_(1.5)

    assert_served_and_live(tiny_glm4, name, scale)


def test_glm4_rmsnorm_is_the_stock_one_the_compiled_step_replaces(tiny_glm4):
    """The engine's --enable-torch-compile swaps the norms whose class the family names (hf_rmsnorm): every norm
    of the GLM-4 decoder, the post norms included, is that class."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_glm4, dtype=torch.float32)
    norms = {type(m).__name__ for n, m in model.named_modules() if n.endswith("norm")}
    assert norms == {FAMILIES["glm4"].hf_rmsnorm} == {"Glm4RMSNorm"}
    assert sum(n.endswith(("post_self_attn_layernorm", "post_mlp_layernorm")) for n, _ in model.named_modules()) == 4
