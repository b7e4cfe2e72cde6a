"""The built-in engine serves a Qwen-MoE model under the checkpoint's per-expert names
(engines/embedded/experts.py): each name reads the expert's tensor as saved, and a write through it
changes what the model computes."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from slime_rl.engines.embedded.experts import expert_aliases


def test_expert_aliases_are_the_checkpoint_tensors_and_write_through(tiny_qwen3_moe, tiny_qwen2):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe, dtype=torch.float32).eval()
    params = dict(model.named_parameters(remove_duplicate=False))
    aliases = expert_aliases(params, model.config)
    saved = load_file(tiny_qwen3_moe / "model.safetensors")
    assert set(aliases) == {n for n in saved if ".mlp.experts." in n}  # 2 layers x 8 experts x 3
    assert len(aliases) == 48
    for name, view in aliases.items():
        assert torch.equal(view, saved[name]), name  # same values, same [out, in] layout
        assert not view.requires_grad
    # every other checkpoint name is a parameter of the model itself
    assert {n for n in saved if ".mlp.experts." not in n} <= set(params)
    tokens = torch.tensor([[3, 8, 13, 21, 34]])
    with torch.no_grad():
        before = model(tokens).logits
        for e in range(8):  # zero every expert's down projection of layer 1: its MoE output is 0
            aliases[f"model.layers.1.mlp.experts.{e}.down_proj.weight"].zero_()
        after = model(tokens).logits
    assert not torch.equal(before, after)
    assert float(params["model.layers.1.mlp.experts.down_proj"].abs().max()) == 0.0
    dense = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    assert expert_aliases(dict(dense.named_parameters()), dense.config) == {}


def test_qwen2_moe_every_checkpoint_name_is_served(tiny_qwen2_moe):
    """Qwen2-MoE (shared expert, a dense layer 2): the aliases are the sparse layers' experts; every
    other checkpoint name (shared expert, its gate, the dense MLP, q/k/v biases) is a parameter of
    the model, so a weight update under any name we send reaches the tensor the model computes with."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_moe, dtype=torch.float32).eval()
    params = dict(model.named_parameters(remove_duplicate=False))
    aliases = expert_aliases(params, model.config)
    saved = load_file(tiny_qwen2_moe / "model.safetensors")
    assert set(aliases) == {n for n in saved if ".mlp.experts." in n}
    assert len(aliases) == 3 * 8 * 3 and not any(n.startswith("model.layers.2.") for n in aliases)
    served = {**params, **aliases}
    assert set(saved) <= set(served)
    for name, t in saved.items():
        assert torch.equal(served[name].detach(), t), name
    tokens = torch.tensor([[3, 8, 13, 21, 34]])
    with torch.no_grad():
        before = model(tokens).logits
        served["model.layers.3.mlp.shared_expert_gate.weight"].zero_()  # the gate at sigmoid(0) = 1/2
        after = model(tokens).logits
    assert not torch.equal(before, after)


class _StubEngine:
    """What MemoryOccupation calls on the engine; records whether /generate would be served."""

    def __init__(self) -> None:
        import threading

        self.device, self.model_lock, self.unavailable = torch.device("cpu"), threading.Lock(), None

    def set_unavailable(self, message):
        self.unavailable = message

    def wait_weights(self):
        pass

    def drop_static_state(self):
        pass


def test_colocated_refill_by_expert_names(tiny_qwen3_moe):
    """Colocated mode: after a release and a resume, the names weight sync sends (the checkpoint's,
    one per expert) refill every parameter, the fused expert tensors included, and the engine
    serves again; one expert's tensor missing keeps it refusing, naming one tensor."""
    from transformers import AutoModelForCausalLM

    from slime_rl.engines.embedded.memory import MemoryOccupation

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe, dtype=torch.float32).eval()
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(expert_aliases(params, model.config))
    engine = _StubEngine()
    memory = MemoryOccupation(engine, params)
    sent = list(load_file(tiny_qwen3_moe / "model.safetensors"))  # what weight sync sends, by name
    memory.release({"tags": ["weights"]})
    memory.resume({"tags": ["weights"]})
    assert "are not refilled yet" in engine.unavailable
    memory.note_loaded([n for n in sent if n != "model.layers.1.mlp.experts.5.up_proj.weight"])
    assert engine.unavailable is not None and "but 1 of " in engine.unavailable, engine.unavailable
    memory.note_loaded(["model.layers.1.mlp.experts.5.up_proj.weight"])
    assert engine.unavailable is None
    # a sender of the fused names (one per layer and kind) refills them too
    memory.release({"tags": ["weights"]})
    memory.resume({"tags": ["weights"]})
    memory.note_loaded([n for n in dict(model.named_parameters())])
    assert engine.unavailable is None
