"""The embedded engine on CUDA (float32 and bf16) and weight sync over NCCL (needs 2 GPUs).
Marked `gpu`: skipped on machines without CUDA."""

from __future__ import annotations

import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from engine_testlib import prompt_of, reference_logprobs, start_server

from slime_rl.engines import dist_group
from slime_rl.engines.launch import embedded_command, wait_healthy
from slime_rl.rollout.client import EngineClient

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


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL weight sync needs two GPUs (one per rank)")
def test_nccl_weight_update_from_a_trainer_rank(tiny_qwen2, tmp_path):
    from transformers import AutoModelForCausalLM

    port, gport = _free_port(), _free_port()
    log = tmp_path / "engine.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(embedded_command(tiny_qwen2, "127.0.0.1", port, device="cuda:1"),
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
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(client.update_weights_from_distributed, [n for n, _ in new],
                              [t.dtype for _, t in new], [list(t.shape) for _, t in new], group_name="wu",
                              weight_version="gpu-1")
            for _, t in new:
                dist_group.broadcast(pg, t, src=0)
            assert fut.result()["success"] is True
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
