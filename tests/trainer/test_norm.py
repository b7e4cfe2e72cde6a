"""The trainer's RMSNorm (trainer/norm.py): the engine's rounding bit for bit, a correct backward, and
every norm of the built model is it (with and without sequence parallelism)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from slime_rl.engines.embedded.precision import rmsnorm_fp32_weight
from slime_rl.trainer.norm import TrainerRMSNorm, rms_norm
from tests.trainer.trainer_ref import make_tiny_qwen3

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [64, 576, 3584])
def test_forward_is_the_engines_rounding_bit_for_bit(dtype, hidden):
    """Against the engine's own RMSNorm island (what SGLang's forward_native computes): equal bits
    in every precision, for weights that are the model's dtype (as Float16Module leaves them)."""
    torch.manual_seed(hidden)
    x = (torch.randn(3, 37, hidden) * 4).to(dtype)
    w = (torch.rand(hidden) + 0.5).to(dtype)
    got = rms_norm(x, w, 1e-6)
    assert got.dtype == dtype
    assert torch.equal(got, rmsnorm_fp32_weight(x, w, 1e-6))


def test_forward_equals_hf_llama_rmsnorm_in_fp32():
    """In fp32 the engine runs HF's own LlamaRMSNorm (no precision island): the same bits."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    hf = LlamaRMSNorm(96, eps=1e-5)
    with torch.no_grad():
        hf.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 11, 96) * 3
    assert torch.equal(rms_norm(x, hf.weight.detach(), 1e-5), hf(x).detach())


def test_backward_against_float64_autograd():
    """The analytic backward (input and weight grads) against autograd through torch's own rms_norm,
    in float64, with an upstream gradient that is not all ones; and torch's gradcheck."""
    torch.manual_seed(1)
    x = torch.randn(4, 9, 48, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(48, dtype=torch.float64) + 0.5).requires_grad_()
    g = torch.randn(4, 9, 48, dtype=torch.float64)
    gx, gw = torch.autograd.grad(rms_norm(x, w, 1e-5), (x, w), g)
    rx, rw = torch.autograd.grad(torch.nn.functional.rms_norm(x, (48,), w, 1e-5), (x, w), g)
    torch.testing.assert_close(gx, rx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-12, atol=1e-12)
    small_x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    small_w = (torch.rand(8, dtype=torch.float64) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-5), (small_x, small_w))


def test_bf16_grads_close_to_float64():
    """In bf16 (the loop's dtype) the grads are the float64 ones rounded: within bf16's resolution."""
    torch.manual_seed(2)
    x64 = torch.randn(6, 128, dtype=torch.float64)
    w64 = torch.rand(128, dtype=torch.float64) + 0.5
    g64 = torch.randn(6, 128, dtype=torch.float64)
    x, w = x64.bfloat16().requires_grad_(), w64.bfloat16().requires_grad_()
    gx, gw = torch.autograd.grad(rms_norm(x, w, 1e-5), (x, w), g64.bfloat16())
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rx, rw = torch.autograd.grad(torch.nn.functional.rms_norm(xr, (128,), wr, 1e-5), (xr, wr),
                                 g64.bfloat16().double())
    assert gx.dtype == gw.dtype == torch.bfloat16
    torch.testing.assert_close(gx.double(), rx, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gw.double(), rw, rtol=1e-2, atol=1e-2)


def test_module_keeps_the_sequence_parallel_mark():
    cfg = type("C", (), {"sequence_parallel": True})()
    norm = TrainerRMSNorm(cfg, 32, eps=1e-6)
    assert norm.weight.sequence_parallel is True and norm.eps == 1e-6
    assert not hasattr(TrainerRMSNorm(type("C", (), {"sequence_parallel": False})(), 32).weight, "sequence_parallel")


PROBE = textwrap.dedent("""
    import json, socket, sys
    from slime_rl.trainer.parallel import init_parallel
    from slime_rl.trainer.model import build_from_checkpoint
    from megatron.core.transformer.module import Float16Module
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    init_parallel(0, 1, "127.0.0.1", port)
    out = {}
    for ckpt in sys.argv[1:]:
        arch, model = build_from_checkpoint(ckpt, bf16=True)
        Float16Module(model.config, model)  # as the loop's worker wraps it: every param to bf16
        out[ckpt] = sorted({f"{type(m).__module__}.{type(m).__name__}" for n, m in model.named_modules()
                            if "norm" in type(m).__name__.lower()})
        out[ckpt + ":names"] = sorted(n for n, m in model.named_modules() if "norm" in type(m).__name__.lower())
    print("RESULT " + json.dumps(out))
""")


def test_every_norm_of_the_built_model_is_ours(tiny_llama, tmp_path):
    """Built as the trainer builds it (one gloo rank, in a subprocess): the input, pre-MLP, q/k
    (Qwen3) and final norms are all TrainerRMSNorm, none torch's own (whose fused bf16 kernel rounds
    differently from the engine)."""
    qwen3 = make_tiny_qwen3(tmp_path / "qwen3")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", PROBE, str(tiny_llama), str(qwen3)], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, res.stderr[-3000:]
    out = json.loads(line[-1][len("RESULT "):])
    for ckpt in (tiny_llama, qwen3):
        assert out[str(ckpt)] == ["slime_rl.trainer.norm.TrainerRMSNorm"]
    names = out[str(qwen3) + ":names"]
    assert "decoder.final_layernorm" in names
    for layer in (0, 1):
        for part in ("input_layernorm", "pre_mlp_layernorm", "self_attention.q_layernorm",
                     "self_attention.k_layernorm"):
            assert f"decoder.layers.{layer}.{part}" in names
