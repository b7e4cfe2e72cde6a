"""--enable-torch-compile (SGLang's flag): the static decode step with its RMSNorms, MLPs and RoPE
compiled by torch.compile (compiled.py; inductor, here on CPU) gives the tokens and log-probs of the
dynamic path, with the uncompiled static step serving the batches above --torch-compile-max-bs in
the same run."""

from __future__ import annotations

import pytest
import torch
from test_embedded_static import make_requests
from transformers import AutoModelForCausalLM, AutoTokenizer

from slime_rl.engines.embedded.engine import Engine


@pytest.mark.slow
def test_compiled_static_step_equals_the_dynamic_path(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    eos = {tok.eos_token_id}
    ref_engine = Engine(model, tok, eos, 0, max_running_requests=10)
    ref = make_requests(64)
    ref_engine.submit(ref)
    for r in ref:
        assert r.done.wait(120)
    ref_engine.shutdown()

    # 4 slots for 10 requests: padded batches of 4 run the plain static step, of 1 and 2 the compiled one
    eng = Engine(model, tok, eos, 0, max_running_requests=4, static_cache=True, capacity=16, min_kv_len=8,
                 compile_max_bs=2)
    reqs = make_requests(64)
    eng.submit(reqs)
    for r in reqs:
        assert r.done.wait(600)
    stats = eng.load()
    eng.shutdown()
    for i, (got, want) in enumerate(zip(reqs, ref, strict=True)):
        assert got.output_ids == want.output_ids, i
        assert got.finish_reason == want.finish_reason, i
        torch.testing.assert_close(torch.tensor(got.output_logprobs), torch.tensor(want.output_logprobs),
                                   atol=1e-5, rtol=0)
    assert 0 < stats["compiled_forwards"] < stats["decode_forwards"], stats
    assert eng._static.compile_max_bs == 2  # no compiler failure switched it off
    sampler = eng._static._sampler  # the compiled sampler drew the compiled steps' tokens
    assert sampler is not None and sampler.calls > 0 and sampler.failed is None
    pieces = eng._static._compiled
    # 2 layers: 2 norms each and the final one; 2 MLPs; the modeling module's RoPE
    assert pieces.installed == ["rmsnorm x5", "silu_mlp x2", "rope"] and pieces.calls > 0
    # prefill and the batches above the bound ran the modules' own forwards: now inactive, a norm
    # gives its own forward's result
    norm = model.model.norm
    x = torch.randn(3, 64)
    assert not pieces.active and torch.equal(norm(x), norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                                                  + norm.variance_epsilon)))


def test_compiled_sampler_draws_the_eager_samplers_tokens():
    """The compiled sampler (inductor on CPU; x - logsumexp(x) in place of the log-softmax) against
    sampling.gumbel_pick run eagerly on the same uniforms: the same tokens, the same log-probs up to
    fp32 rounding, for every row sampling, for
    greedy rows beside sampling ones, and for an all-greedy batch (no uniforms); two batch sizes
    through one compile (dynamic shapes)."""
    from slime_rl.engines.embedded.compiled import CompiledSampler
    from slime_rl.engines.embedded.sampling import gumbel_pick

    torch.manual_seed(0)
    sampler = CompiledSampler()
    for B in (5, 9):
        logits, temp = (torch.randn(B, 3001) * 4).bfloat16(), torch.rand(B) + 0.5
        u = torch.rand(B, 3001)
        sampled = torch.arange(B) % 3 != 0
        for args in ((u, None), (u, sampled), (None, None)):
            u_eager = None if args[0] is None else args[0].clone()  # eagerly the uniforms are overwritten
            got, want = sampler(logits, temp, *args), gumbel_pick(logits, temp, u_eager, args[1])
            assert torch.equal(got[0], want[0]), (B, args[1] is None)
            torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
    assert sampler.failed is None and sampler.calls == 6


def test_cli_passes_the_compile_flags():
    from slime_rl.config.builtin_engine import ServerConfig, parse_server_args
    from slime_rl.engines.launch import embedded_command as cmd

    argv = cmd(ServerConfig("/m", "127.0.0.1", 1, enable_torch_compile=True, torch_compile_max_bs=64))
    args = parse_server_args(argv[3:])
    assert args.enable_torch_compile and args.torch_compile_max_bs == 64
    assert parse_server_args(["--model-path", "/m"]).torch_compile_max_bs == 32  # SGLang's default


@pytest.mark.slow
def test_pieces_equal_the_modules_forwards_bit_for_bit_in_bf16(tiny_llama):
    """Each compiled piece (inductor, emulating eager's bf16 roundings) against the forward it stands
    in for, on a bf16 model with SGLang's RMSNorm island (precision.py) and without it."""
    from slime_rl.engines.embedded.compiled import CompiledPieces, _silu_mlp
    from slime_rl.engines.embedded.precision import apply_precision_policy

    for island in (True, False):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).eval()
        if island:
            assert "rmsnorm x5" in apply_precision_policy(model)
        layer = model.model.layers[0]
        torch.manual_seed(0)
        x = (torch.randn(3, 5, 64) * 4).bfloat16()
        q, k = torch.randn(3, 4, 5, 16).bfloat16(), torch.randn(3, 2, 5, 16).bfloat16()
        cos, sin = torch.randn(3, 5, 16).bfloat16(), torch.randn(3, 5, 16).bfloat16()
        import transformers.models.llama.modeling_llama as ml

        want = (layer.input_layernorm(x), layer.mlp(x), ml.apply_rotary_pos_emb(q, k, cos, sin))
        pieces = CompiledPieces(model)
        pieces.active = True
        got = (layer.input_layernorm(x), layer.mlp(x), ml.apply_rotary_pos_emb(q, k, cos, sin))
        pieces.active = False
        assert pieces.calls == 2
        again = CompiledPieces(model)  # a second decoder on the same model (bench/decode_step.py makes one
        again.active = True            # per batch size) wraps the wrappers: the same results
        assert torch.equal(layer.input_layernorm(x), want[0]) and torch.equal(layer.mlp(x), want[1]), island
        again.active = False
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), island
        assert torch.equal(got[2][0], want[2][0]) and torch.equal(got[2][1], want[2][1]), island
        # the test can tell: without the emulated roundings the MLP differs
        loose = torch.compile(_silu_mlp, dynamic=True)
        mlp = layer.mlp
        assert not torch.equal(loose(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight), want[1])


def test_rope_function_unwraps_the_kernels_hub_wrapper():
    """transformers >= 5.25 installs `kernels`, whose use_kernel_forward_from_hub turns
    `apply_rotary_pos_emb` into an nn.Module instance; the engine compiles the function behind it.
    Driven with kernels' own decorator (and the installed Llama module, whichever form it has): the
    unwrapped function gives the wrapper's results, and a non-RoPE object gives None."""
    import types

    import transformers.models.llama.modeling_llama as llama

    from slime_rl.engines.embedded.compiled import rope_function

    kernels = pytest.importorskip("kernels")

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        return q * cos.unsqueeze(unsqueeze_dim) + 1, k * sin.unsqueeze(unsqueeze_dim) - 1

    wrapped = kernels.use_kernel_forward_from_hub("rotary_pos_emb")(apply_rotary_pos_emb)
    assert isinstance(wrapped, torch.nn.Module)  # the form transformers 5.25 has
    assert rope_function(wrapped) is apply_rotary_pos_emb
    assert rope_function(apply_rotary_pos_emb) is apply_rotary_pos_emb
    assert rope_function(torch.nn.Linear(2, 2)) is None and rope_function(None) is None

    fn = rope_function(llama.apply_rotary_pos_emb)
    assert isinstance(fn, types.FunctionType)
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8)
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    for got, want in zip(fn(q, k, cos, sin), llama.apply_rotary_pos_emb(q, k, cos, sin), strict=True):
        assert torch.equal(got, want)
