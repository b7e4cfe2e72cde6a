"""--enable-torch-compile (SGLang's flag): the static decode step compiled by torch.compile
(inductor, here on CPU) gives the tokens and log-probs of the dynamic path, with the uncompiled
static step serving the batches above --torch-compile-max-bs in the same run."""

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


def test_cli_passes_the_compile_flags():
    from slime_rl.engines.embedded.cli import build_parser
    from slime_rl.engines.launch import embedded_command as cmd

    argv = cmd("/m", "127.0.0.1", 1, enable_torch_compile=True, torch_compile_max_bs=64)
    args = build_parser().parse_args(argv[3:])
    assert args.enable_torch_compile and args.torch_compile_max_bs == 64
    assert build_parser().parse_args(["--model-path", "/m"]).torch_compile_max_bs == 32  # SGLang's default
