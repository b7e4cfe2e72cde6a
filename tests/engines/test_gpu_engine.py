"""The embedded engine on CUDA (float32 and bf16; decode replayed from CUDA graphs by default, and
against the eager path) and weight sync over NCCL (needs 2 GPUs). Marked `gpu`: skipped on machines
without CUDA."""

from __future__ import annotations

import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from engine_testlib import prompt_of, reference_logprobs, start_server

from slime_rl.config.builtin_engine import ServerConfig
from slime_rl.engines import dist_group
from slime_rl.engines.client import EngineClient
from slime_rl.engines.launch import embedded_command, wait_healthy

pytestmark = pytest.mark.gpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# float32 on GPU differs from the float64 CPU reference by kernel order only (TF32 is off for float32
# matmuls by default); bf16 weights and activations move log-probs by up to a few 1e-2.
@pytest.mark.parametrize("dtype, atol", [("float32", 1e-4), ("bfloat16", 0.15)])
def test_generate_on_cuda_matches_reference(tiny_qwen2, model64, dtype, atol):
    s = start_server(tiny_qwen2, device="cuda", dtype=dtype)
    try:
        with httpx.Client(base_url=s.url, timeout=120) as c, ThreadPoolExecutor(6) as pool:
            bodies = [{"input_ids": prompt_of(3 + 2 * i, salt=i), "return_logprob": True,
                       "sampling_params": {"max_new_tokens": 8, "temperature": 0.9, "ignore_eos": True,
                                           "sampling_seed": i}} for i in range(6)]
            outs = list(pool.map(lambda b: c.post("/generate", json=b).json(), bodies))
        for b, o in zip(bodies, outs, strict=True):
            ref = reference_logprobs(model64, b["input_ids"], o["output_ids"], 0.9)
            got = torch.tensor([lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
            torch.testing.assert_close(got, ref, atol=atol, rtol=0)
    finally:
        s.shutdown()


def _staggered(url: str, bodies: list[dict]) -> list[dict]:
    """All bodies concurrently, the second half a little later: they join a batch that is decoding."""
    with httpx.Client(base_url=url, timeout=120) as c, ThreadPoolExecutor(len(bodies)) as pool:
        futures = []
        for i, b in enumerate(bodies):
            if i == len(bodies) // 2:
                time.sleep(0.05)
            futures.append(pool.submit(lambda b=b: c.post("/generate", json=b).json()))
        return [f.result() for f in futures]


def _nudge_weights(server) -> None:
    """Change every weight in place, as a weight update does (captured graphs must see it)."""
    gen = torch.Generator().manual_seed(7)
    with server.engine.weights_exclusive(), torch.no_grad():
        for _, p in server.model.named_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p))


def test_cuda_graph_decode_matches_eager_decode(tiny_qwen2):
    # greedy, prompts of 3..48 tokens, 6..30 new tokens and one of 230: rows finish at different
    # steps (padded batch sizes 8, 4, 2, 1, slot compaction), the last one crosses from kv_len 256 to
    # 512; float32 so that the two paths' different kernels (padded dynamic cache vs static slots)
    # cannot flip a greedy token
    bodies = [{"input_ids": prompt_of(3 + 5 * i, salt=i), "return_logprob": True,
               "sampling_params": {"max_new_tokens": 6 + 3 * i if i < 9 else 230, "temperature": 0.0,
                                   "ignore_eos": True}}
              for i in range(10)]
    runs, stats = {}, {}
    # graph_serial: the overlap scheduler off (each step's tokens read before the next is launched)
    for name, kw in [("eager", {"disable_cuda_graph": True}), ("graph", {}), ("graph_bs2", {"cuda_graph_max_bs": 2}),
                     ("graph_serial", {"disable_overlap_schedule": True}),
                     # --enable-torch-compile: batches up to 4 captured with compiled.py's pieces
                     ("graph_compiled", {"enable_torch_compile": True, "torch_compile_max_bs": 4})]:
        s = start_server(tiny_qwen2, device="cuda", dtype="float32", max_running_requests=8, **kw)
        try:
            runs[name] = _staggered(s.url, bodies)
            _nudge_weights(s)
            runs[name + "_updated"] = _staggered(s.url, bodies)
            stats[name] = s.engine.load()
        finally:
            s.shutdown()
    for name in ("graph", "graph_bs2", "graph_serial", "graph_compiled"):
        for phase in ("", "_updated"):
            for want, got in zip(runs["eager" + phase], runs[name + phase], strict=True):
                assert got["output_ids"] == want["output_ids"], (name + phase, want["output_ids"], got["output_ids"])
                lp = [[x for x, _, _ in o["meta_info"]["output_token_logprobs"]] for o in (got, want)]
                torch.testing.assert_close(torch.tensor(lp[0]), torch.tensor(lp[1]), atol=1e-4, rtol=0)
    assert any(a["output_ids"] != b["output_ids"] for a, b in zip(runs["graph"], runs["graph_updated"], strict=True))
    # --disable-cuda-graph: no graph captured or replayed. Under deterministic inference (start_server's default)
    # the decode runs on the slot cache, eagerly (server.decodes_on_slots: its flash decode attention needs it)
    e = stats["eager"]
    assert e["graph_captures"] == 0 == e["graph_replays"] and e["static_eager_steps"] > 0, e
    g = stats["graph"]
    assert g["graph_captures"] >= 2 and g["graph_replays"] > 0 and g["static_eager_steps"] == 0, g
    assert g["overlapped_steps"] > 0 and stats["graph_serial"]["overlapped_steps"] == 0
    b2 = stats["graph_bs2"]  # batches above --cuda-graph-max-bs-decode 2 run the static step eagerly
    assert b2["graph_replays"] > 0 and b2["static_eager_steps"] > 0, b2
    c = stats["graph_compiled"]
    assert c["compiled_forwards"] > 0 and c["graph_replays"] > 0, c  # compiled forwards are captured ones


def _one_batch(http: httpx.Client, n_new: int = 20) -> list[tuple[list[int], list[float]]]:
    """Six prompts in one batch request (so the batch composition is the same every time): greedy
    and seeded sampling rows, (tokens, log-probs) per row."""
    body = {"input_ids": [prompt_of(3 + 4 * i, salt=i) for i in range(6)], "return_logprob": True,
            "sampling_params": [{"max_new_tokens": n_new, "ignore_eos": True,
                                 **({"temperature": 0.0} if i % 2 else {"temperature": 0.9, "sampling_seed": i})}
                                for i in range(6)]}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in r.json()]


def test_deterministic_inference_with_torch_compile_stays_batch_invariant_in_bf16(tiny_qwen2):
    """--enable-deterministic-inference with --enable-torch-compile (a candidate for the 1-GPU recipes,
    which run the first alone). With both on, in
    bf16, a request's tokens and log-probs do not depend on what else is in the batch (each row alone
    equals the same row inside a six-row batch, bit for bit), the compiled pieces are what ran, and the
    result stays within bf16 rounding of the deterministic engine without compile."""
    rows = {}
    for name, kw in [("det", {}), ("det_compiled", {"enable_torch_compile": True, "torch_compile_max_bs": 8})]:
        s = start_server(tiny_qwen2, device="cuda", dtype="bfloat16", max_running_requests=8, **kw)
        try:
            with httpx.Client(base_url=s.url, timeout=120) as http:
                batch = _one_batch(http)
                alone = []
                for i in range(6):
                    body = {"input_ids": prompt_of(3 + 4 * i, salt=i), "return_logprob": True,
                            "sampling_params": {"max_new_tokens": 20, "ignore_eos": True,
                                                **({"temperature": 0.0} if i % 2 else
                                                   {"temperature": 0.9, "sampling_seed": i})}}
                    o = http.post("/generate", json=body).json()
                    alone.append((o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]))
            stats = s.engine.load()
        finally:
            s.shutdown()
        for i, (a, b) in enumerate(zip(alone, batch, strict=True)):
            assert a[0] == b[0], (name, i, a[0], b[0])
            assert torch.equal(torch.tensor(a[1]), torch.tensor(b[1])), (name, i)
        rows[name] = batch
        if name == "det_compiled":
            assert stats["compiled_forwards"] > 0, stats
            assert s.engine._static.compile_max_bs == 8  # no compiler failure switched compile off
    for (ids, lp), (ids_c, lp_c) in zip(rows["det"], rows["det_compiled"], strict=True):
        n = next((k for k, (x, y) in enumerate(zip(ids, ids_c, strict=True)) if x != y), len(ids))
        torch.testing.assert_close(torch.tensor(lp_c[:n]), torch.tensor(lp[:n]), atol=0.05, rtol=0)
        assert n >= 5  # a flip in the first few tokens would be more than rounding


def test_cuda_graphs_survive_a_colocated_release_and_resume(tiny_qwen2):
    """Colocated mode frees the weights and the KV cache after every rollout: the graphs stay valid when
    the weights and the cache come back at their old addresses (one same-size storage each,
    memory.py/slots.py) and are captured again when one moved (on the H200, 2026-12-01, they moved:
    capturing into the dropped graphs' pool then failed torch's allocator assert and switched graphs
    off); the outputs after each resume equal those before and the eager path's."""
    eager = start_server(tiny_qwen2, device="cuda", dtype="float32", disable_cuda_graph=True)
    try:
        with httpx.Client(base_url=eager.url, timeout=120) as http:
            want = _one_batch(http)
    finally:
        eager.shutdown()
    s = start_server(tiny_qwen2, device="cuda", dtype="float32", enable_weights_cpu_backup=True)
    try:
        with httpx.Client(base_url=s.url, timeout=120) as http:
            first = _one_batch(http)
            captured = s.engine.load()["graph_captures"]
            for _ in range(3):  # a few colocated steps
                assert http.post("/release_memory_occupation", json={}).status_code == 200
                assert s.memory.info()["weights_bytes"] == 0
                for tags in (["weights"], ["kv_cache", "cuda_graph"]):  # the loop's order (cluster.py)
                    assert http.post("/resume_memory_occupation", json={"tags": tags}).status_code == 200
                again = _one_batch(http)
                assert [t for t, _ in again] == [t for t, _ in first]
                assert again == first  # same batch, same graphs: bit-identical
            stats = s.engine.load()
    finally:
        s.shutdown()
    # the graphs are kept when the re-allocated storages come back at their old addresses, and
    # captured again (into a new pool) when one moved; either way every step ran on graphs
    print(f"graphs over 3 release/resume cycles: {stats}")
    assert captured > 0 and stats["static_eager_steps"] == 0, stats
    kept, moved = stats["graphs_kept_after_release"], stats["graphs_dropped_moved"]
    assert kept + moved >= 3 * captured, stats
    assert stats["graph_captures"] == captured * (1 + moved // captured), stats
    for (wt, wl), (gt, gl) in zip(want, first, strict=True):
        assert gt == wt
        torch.testing.assert_close(torch.tensor(gl), torch.tensor(wl), atol=1e-4, rtol=0)


def test_one_host_synchronization_per_decode_step(tiny_qwen2):
    """torch's sync debug mode warns at every host synchronization; the decode steps of a batch add
    one each (the sampled tokens' copy), whatever the prefill costs."""
    import warnings

    s = start_server(tiny_qwen2, device="cuda", dtype="float32")
    seen: list[str] = []
    show = warnings.showwarning
    try:
        with httpx.Client(base_url=s.url, timeout=120) as http:
            _one_batch(http, 40)  # capture the graphs first (capture synchronizes)

            def count(n_new: int) -> tuple[int, int]:
                steps0, seen0 = s.engine.load()["decode_forwards"], len(seen)
                _one_batch(http, n_new)
                return s.engine.load()["decode_forwards"] - steps0, len(seen) - seen0

            warnings.showwarning = lambda message, *a, **k: seen.append(str(message))
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    short_steps, short_syncs = count(2)
                    long_steps, long_syncs = count(34)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = show
        s.shutdown()
    assert long_steps - short_steps == 32
    assert long_syncs - short_syncs <= 32, seen[-10:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL weight sync needs two GPUs (one per rank)")
def test_nccl_weight_update_from_a_trainer_rank(tiny_qwen2, tmp_path):
    from transformers import AutoModelForCausalLM

    port, gport = _free_port(), _free_port()
    log = tmp_path / "engine.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(embedded_command(ServerConfig(str(tiny_qwen2), "127.0.0.1", port, device="cuda:1")),
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout=180, process=proc, log_path=log)
        client = EngineClient(url, timeout=120)
        torch.cuda.set_device(0)
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(client.init_weights_update_group, "127.0.0.1", gport, 1, 2, "wu", "nccl")
            pg = dist_group.init_custom_group("127.0.0.1", gport, 0, 2, "wu", "nccl")
            assert joined.result()["success"] is True
        ref = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
        gen = torch.Generator().manual_seed(1)
        new = [(n, torch.randn(p.shape, generator=gen).to("cuda:0")) for n, p in ref.named_parameters()]
        assert client.open_weight_update_session() is True  # SGLang 0.5.23 refuses updates outside one
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(client.update_weights_from_distributed, [n for n, _ in new],
                              [t.dtype for _, t in new], [list(t.shape) for _, t in new], group_name="wu",
                              weight_version="gpu-1")
            for _, t in new:
                dist_group.broadcast(pg, t, src=0)
            assert fut.result()["success"] is True
        client.close_weight_update_session()
        for name, t in new:
            got = torch.tensor(client.get_weights_by_name(name, truncate_size=10**6))
            assert torch.equal(got, t.cpu()), name
        out = client.generate(prompt_of(5), {"max_new_tokens": 4})
        assert out["meta_info"]["weight_version"] == "gpu-1"
        assert client.destroy_weights_update_group("wu")["success"] is True
        dist_group.destroy_group(pg)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
