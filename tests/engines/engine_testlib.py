"""Helpers shared by the engine tests (a uniquely named module: `conftest` names are ambiguous)."""

from __future__ import annotations

from pathlib import Path

from slime_rl.engines.embedded.server import EmbeddedServer, ServerConfig
from tests.logprob_ref import reference_logprobs  # noqa: F401 (re-exported for the tests)


def start_server(model_path: Path, **kw) -> EmbeddedServer:
    """port=0: the OS picks a free loopback port (no race with other tests). Requests' sampling_seed
    is honoured (enable_deterministic_inference, as SGLang needs it) unless the caller says otherwise."""
    kw.setdefault("enable_deterministic_inference", True)
    return EmbeddedServer(ServerConfig(model_path=str(model_path), host="127.0.0.1", port=0, **kw)).start()


def prompt_of(n: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of n ordinary ids in [0, 61) (61-63 are the tiny tokenizer's specials)."""
    return [(7 * i + 11 * salt + 5) % 61 for i in range(n)]


def causal_packed_attention(q, k, v, cu, scale: float):
    """Float64 causal attention over each packed row [cu[i], cu[i+1]) of q/k/v [T, heads, D] (the
    same heads on all three), cast back to q's dtype: what torch's varlen flash computes."""
    import torch

    out = torch.empty_like(q)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        s = torch.einsum("thd,shd->hts", q[a:b].double(), k[a:b].double()) * scale
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        out[a:b] = torch.einsum("hts,shd->thd", s.softmax(-1), v[a:b].double()).to(q.dtype)
    return out


def assert_served_and_live(ckpt: Path, name: str, change) -> None:
    """Every tensor of the checkpoint is a weight update target of the built-in engine's model under its
    checkpoint name, holding the stored values, and changing the one named `name` in place (`change(t)`)
    changes the model's logits: the engine computes with what a weight update writes."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from slime_rl.engines.embedded.weights import WeightSync

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    saved = load_file(ckpt / "model.safetensors")
    served = WeightSync(model, engine=None, weight_version="0").params
    assert set(saved) <= set(served)
    for n, t in saved.items():
        assert torch.equal(served[n].detach(), t), n
    tokens = torch.tensor([prompt_of(12)])
    with torch.no_grad():
        before = model(tokens).logits
        change(served[name])
        after = model(tokens).logits
    assert not torch.equal(before, after)
