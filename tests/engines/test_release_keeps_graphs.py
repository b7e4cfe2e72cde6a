"""Colocated release/resume on the static path keeps what the CUDA graphs bake in: the weights are
one storage (memory.pack_parameters) and the KV cache is one storage (slots.SlotCache), each freed
and re-allocated in one piece; before the first replay after a release the decoder compares the
addresses the graphs were captured with and drops the graphs only if one moved. On CPU there are no
graphs: this checks the packing, the release/restore of the cache, the address check itself, and
that tokens and log-probs after release/resume equal those before (the GPU half, that nothing is
captured again, is tests/engines/test_gpu_engine.py)."""

from __future__ import annotations

import httpx
import pytest
import torch
from engine_testlib import prompt_of, start_server

from slime_rl.engines.embedded.memory import ALIGN, pack_parameters


def test_pack_parameters_keeps_values_ties_and_dtypes():
    emb = torch.nn.Embedding(7, 3)
    head = torch.nn.Linear(3, 7, bias=False)
    head.weight = emb.weight  # tied
    norm = torch.nn.Linear(5, 1).to(torch.float64)
    half = torch.nn.Linear(3, 3).to(torch.bfloat16)
    params = [emb.weight, norm.weight, norm.bias, half.weight, half.bias]
    before = [p.detach().clone() for p in params]
    groups = [[emb.weight, head.weight]] + [[p] for p in params[1:]]
    arena = pack_parameters(groups, torch.device("cpu"))
    for p, b in zip(params, before, strict=True):
        assert p.dtype == b.dtype and torch.equal(p.detach(), b)
        assert p.untyped_storage().data_ptr() == arena.data_ptr()
        assert (p.data_ptr() - arena.data_ptr()) % ALIGN == 0
    assert head.weight is emb.weight and head.weight.data_ptr() == emb.weight.data_ptr()
    # by hand: storages of 84, 40, 8, 18 and 6 bytes at offsets 0, 256, 512, 768, 1024
    assert arena.nbytes() == 4 * 256 + 6
    with torch.no_grad():
        emb.weight[0, 0] = 5.0  # a write through one view is seen through the arena
    assert torch.empty(0).set_(arena, 0, (1,))[0].item() == 5.0
    arena.resize_(0)
    arena.resize_(4 * 256 + 6)
    assert norm.bias.shape == (1,) and norm.bias.data_ptr() == arena.data_ptr() + 2 * 256


@pytest.fixture(scope="module")
def server(tiny_qwen2):
    s = start_server(tiny_qwen2, random_seed=9, static_kv_cache=True, enable_weights_cpu_backup=True)
    yield s
    s.shutdown()


def run(http) -> list:
    body = {"input_ids": [prompt_of(4 + 3 * i, salt=i) for i in range(5)], "return_logprob": True,
            "sampling_params": [{"max_new_tokens": 12, "temperature": 0.8, "ignore_eos": True, "sampling_seed": 40 + i}
                                for i in range(5)]}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in r.json()]


def test_release_resume_gives_the_same_tokens_and_logprobs(server):
    static = server.engine._static
    with httpx.Client(base_url=server.url, timeout=120) as http:
        before = run(http)
        cache = static.cache
        kv_bytes = cache.arena.nbytes()
        assert kv_bytes > 0 and cache.layers
        assert http.post("/release_memory_occupation", json={}).status_code == 200
        assert cache.arena.nbytes() == 0 and cache.released and len(cache.layers) > 0
        assert server.memory.weights_bytes() == 0
        assert http.post("/resume_memory_occupation", json={}).status_code == 200
        after = run(http)
    assert not cache.released and cache.arena.nbytes() == kv_bytes
    assert after == before  # same batch, same seeds: bit-identical tokens and log-probs


def test_the_address_check_keeps_or_drops_graphs(server):
    """Graphs are stand-ins here (CPU captures none): the check must keep them while every baked
    address is unchanged and drop them once one moved."""
    static = server.engine._static
    with server.engine.model_lock:
        static.graphs = {(1, 256): ("graph", None)}
        static._graph_addresses = static.addresses()
        kept, dropped = static.stats["graphs_kept_after_release"], static.stats["graphs_dropped_moved"]
        static._check_addresses = True
        static._verify_graphs()
        assert static.graphs and static.stats["graphs_kept_after_release"] == kept + 1
        p = next(server.model.parameters())
        old = p.data
        p.data = p.data.clone()  # the parameter now lives elsewhere: a graph would read stale memory
        try:
            static._check_addresses = True
            static._verify_graphs()
        finally:
            p.data = old
        assert static.graphs == {} and static.stats["graphs_dropped_moved"] == dropped + 1
