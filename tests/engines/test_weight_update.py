"""Weight sync over gloo: this test process is the trainer (rank 0, store master); a standalone
embedded engine started with `python -m slime_rl.engines.embedded` is rank 1.

After `/update_weights_from_distributed` with a fresh random tensor for every parameter, every
engine parameter must equal the sent tensor exactly (read back with SGLang's /get_weights_by_name),
generation must match a float64 reference model holding the same tensors, and weight_version must
have moved. Also: a name the model lacks is refused naming it (after the broadcast, so the trainer
does not hang), and an update waits for a running request instead of changing weights under it.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from engine_testlib import prompt_of, reference_logprobs

from slime_rl.config.builtin_engine import ServerConfig
from slime_rl.engines import dist_group
from slime_rl.engines.client import EngineClient, EngineError
from slime_rl.engines.launch import embedded_command, wait_healthy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engine_proc(tiny_qwen2, tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    argv = embedded_command(ServerConfig(str(tiny_qwen2), "127.0.0.1", port, random_seed=3, num_threads=1))
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=120, process=proc, log_path=log)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def group(engine_proc):
    """Rank 0 here, rank 1 in the engine; both sides block until the other joins, so one runs in a thread."""
    port = _free_port()
    client = EngineClient(engine_proc, timeout=120)
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(client.init_weights_update_group, "127.0.0.1", port, 1, 2, "wu", "gloo")
        pg = dist_group.init_custom_group("127.0.0.1", port, 0, 2, "wu", "gloo")
        assert joined.result() == {"success": True, "message": "Succeeded to initialize custom process group."}
    assert not torch.distributed.is_initialized()  # nothing was registered globally
    yield client, pg
    assert client.destroy_weights_update_group("wu")["success"] is True
    with pytest.raises(EngineError, match="does not exist"):
        client.destroy_weights_update_group("wu")
    client.close()


def push(client: EngineClient, pg, named: list[tuple[str, torch.Tensor]], **kw) -> dict | EngineError:
    """What the trainer does per bucket: send the metadata over HTTP, broadcast the tensors in order,
    inside a weight-update session (SGLang 0.5.23 refuses updates outside one)."""
    assert client.begin_weight_update() == {"success": True, "message": "Success"}
    try:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(client.update_weights_from_distributed, [n for n, _ in named],
                              [t.dtype for _, t in named], [list(t.shape) for _, t in named], group_name="wu", **kw)
            for _, t in named:
                dist_group.broadcast(pg, t, src=0)
            try:
                return fut.result()
            except EngineError as e:
                return e
    finally:
        assert client.end_weight_update()["success"] is True


def test_update_outside_a_session_is_refused_before_the_broadcast(group):
    """SGLang 0.5.23 (weight_updater.py) answers 400 with this message and never joins the bucket's
    broadcast; so nothing is broadcast here, and a session-wrapped update afterwards still lines up."""
    client, pg = group
    with pytest.raises(EngineError) as err:
        client.update_weights_from_distributed(["model.norm.weight"], [torch.float32], [[64]], group_name="wu")
    assert err.value.status == 400
    assert err.value.message == ("update_weights_from_distributed must run between begin_weight_update() and "
                                 "end_weight_update()")
    twos = torch.full((64,), 2.0)
    assert push(client, pg, [("model.norm.weight", twos)])["success"] is True
    assert client.get_weights_by_name("model.norm.weight") == twos.tolist()


def test_update_every_parameter_then_generate(group, tiny_qwen2):
    from transformers import AutoModelForCausalLM

    client, pg = group
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    # named_parameters() lists a tied tensor once (model.embed_tokens.weight), as a trainer sends it.
    new = [(n, 0.05 * torch.randn(p.shape, generator=gen)) for n, p in ref.named_parameters()]
    assert "lm_head.weight" not in dict(new) and ref.config.tie_word_embeddings
    out = push(client, pg, new, weight_version="step-1")
    assert out["success"] is True and "step-1" in out["message"], out

    for name, t in new:
        got = torch.tensor(client.get_weights_by_name(name, truncate_size=10**6), dtype=torch.float32)
        assert torch.equal(got, t), name  # exact: float32 -> JSON double -> float32 round-trips
    lm_head = torch.tensor(client.get_weights_by_name("lm_head.weight", truncate_size=10**6))
    assert torch.equal(lm_head.float(), dict(new)["model.embed_tokens.weight"])  # tied to the embedding

    assert client.get_model_info()["weight_version"] == "step-1"
    prompt = prompt_of(7, salt=11)
    res = client.generate(prompt, {"max_new_tokens": 10, "temperature": 0.8, "ignore_eos": True})
    assert res["meta_info"]["weight_version"] == "step-1"
    with torch.no_grad():
        for name, t in new:
            ref.get_parameter(name).copy_(t)
    ref64 = ref.double().eval()
    want = reference_logprobs(ref64, prompt, res["output_ids"], 0.8)
    got = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_unknown_name_is_refused_after_the_broadcast(group):
    client, pg = group
    err = push(client, pg, [("model.no_such.weight", torch.zeros(3))])
    assert isinstance(err, EngineError) and err.status == 400 and "model.no_such.weight" in err.message
    assert "/update_weights_from_distributed" in str(err)
    err = push(client, pg, [("model.norm.weight", torch.zeros(5))])  # wrong shape
    assert isinstance(err, EngineError) and "model.norm.weight" in err.message and "shape" in err.message
    # the group is still in step: a good update goes through afterwards
    ones = torch.ones(64)
    assert push(client, pg, [("model.norm.weight", ones)], weight_version="step-2")["success"] is True
    assert client.get_weights_by_name("model.norm.weight") == ones.tolist()


def test_update_waits_for_the_running_request(group):
    client, pg = group
    done: dict[str, float] = {}

    def long_request() -> None:
        with EngineClient(client.base_url, timeout=120) as c:
            out = c.generate(prompt_of(4), {"max_new_tokens": 150, "ignore_eos": True})
        done["generate"] = time.monotonic()
        done["finish"] = out["meta_info"]["finish_reason"]["type"]

    def finished() -> int:
        return client.get_server_info()["internal_states"][0]["requests_finished"]

    before = finished()
    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while client.get_server_info()["internal_states"][0]["num_running_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    out = push(client, pg, [("model.norm.weight", torch.full((64,), 2.0))], weight_version="step-3")
    finished_at_update = finished()
    t.join()
    assert out["success"] is True and done["finish"] == "length"  # not aborted: abort_all_requests=False
    # engine-side, not the two responses' arrival order (which races once both are answered at once):
    # when the update answers, the 150-token request has already finished
    assert finished_at_update == before + 1


def test_launch_reports_a_dead_engine(tmp_path):
    from slime_rl.engines.launch import EngineLaunchError

    log = tmp_path / "engine.log"
    argv = embedded_command(ServerConfig(str(tmp_path / "no_model_here"), "127.0.0.1", _free_port()))
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    with pytest.raises(EngineLaunchError, match=r"exited with code [1-9]") as info:
        wait_healthy("http://127.0.0.1:1", timeout=120, process=proc, log_path=log)
    assert "no_model_here" in str(info.value)  # the log tail names what went wrong


def test_flattened_bucket_of_mixed_dtypes(group):
    """load_format="flattened_bucket": the trainer sends every tensor's bytes back to back in ONE uint8
    broadcast (SGLang's FlattenedTensorBucket layout); the engine cuts it by names/dtypes/shapes."""
    client, pg = group
    norm = torch.linspace(-1, 1, 64)  # float32, 256 bytes
    bias = torch.linspace(0, 0.5, 64, dtype=torch.bfloat16)  # bf16, 128 bytes, into a float32 param
    flat = torch.cat([t.flatten().view(torch.uint8) for t in (norm, bias)])
    client.begin_weight_update()
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.update_weights_from_distributed,
                          ["model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.q_proj.bias"],
                          [torch.float32, torch.bfloat16], [[64], [64]], group_name="wu",
                          load_format="flattened_bucket")
        dist_group.broadcast(pg, flat, src=0)
        assert fut.result()["success"] is True
    client.end_weight_update()
    assert client.get_weights_by_name("model.layers.0.input_layernorm.weight") == norm.tolist()
    got = torch.tensor(client.get_weights_by_name("model.layers.1.self_attn.q_proj.bias", 1000))
    assert torch.equal(got, bias.float())


def test_pipelined_sync_of_many_buckets_with_strided_sources(engine_proc, tiny_qwen2):
    """WeightBroadcaster.sync with a bucket cap far below the model: many flattened buckets go through
    its two reused send buffers while the next request is already posted; the sources include
    strided views (a transpose's transpose, the halves of a fused tensor) that are copied straight
    into the buffer. Every engine parameter must equal what was sent, bit for bit."""
    from transformers import AutoModelForCausalLM

    from slime_rl.config import WeightSyncConfig
    from slime_rl.weight_sync.broadcast import EngineTarget, WeightBroadcaster

    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    new = {}
    for n, p in ref.named_parameters():
        if p.dim() == 2:  # a non-contiguous view holding the intended values
            new[n] = (0.05 * torch.randn(p.shape[1], p.shape[0], generator=gen)).t()
        else:  # the second half of a fused [2, ...] tensor: a view at an offset
            new[n] = torch.randn((2, *p.shape), generator=gen)[1]
    assert any(not t.is_contiguous() for t in new.values())
    sync = WeightBroadcaster([EngineTarget(engine_proc, 1)], WeightSyncConfig(4096), True, "127.0.0.1",
                             _free_port(), 2, "gloo", group_name="wu_pipe")
    sync.connect()
    try:
        out = sync.sync(iter(new.items()), version="pipe-1")
    finally:
        sync.close()
    client = EngineClient(engine_proc, timeout=120)
    assert client.destroy_weights_update_group("wu_pipe")["success"] is True
    assert out["weight_sync/buckets"] >= 5, out  # several buckets: both buffers were reused
    assert out["weight_sync/bytes"] == sum(t.numel() * 4 for t in new.values())
    for name, t in new.items():
        got = torch.tensor(client.get_weights_by_name(name, truncate_size=10**6), dtype=torch.float32)
        assert torch.equal(got, t), name
    assert client.get_model_info()["weight_version"] == "pipe-1"
    client.close()


def test_repeated_sync_of_finer_shaped_sources_reuses_its_plans(engine_proc, tiny_qwen2):
    """What the trainer sends at TP=1 (hf_io.iter_hf_sources): (name, source, HF shape) with the
    source a strided view of a larger tensor in a finer shape (a QKV split: (groups, rows, cols)).
    Two syncs with an in-place update of the underlying storage in between: the second reuses
    every bucket's plan (its request and destination views) and the engine must hold the new
    values bit for bit, in the announced HF shapes."""
    from transformers import AutoModelForCausalLM

    from slime_rl.config import WeightSyncConfig
    from slime_rl.weight_sync.broadcast import EngineTarget, WeightBroadcaster

    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    shapes = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    # each tensor is the middle third (dim 1) of a (2, 3 * k, rest) "fused" storage: strided
    fused = {n: torch.randn(2, 3 * (s[0] // 2 if s[0] % 2 == 0 else s[0]), *s[1:], generator=gen)
             for n, s in shapes.items()}
    items = []
    for n, s in shapes.items():
        rows = s[0] // 2 if s[0] % 2 == 0 else s[0]
        src = fused[n][:, rows:2 * rows] if s[0] % 2 == 0 else fused[n][0, rows:2 * rows]
        items.append((n, src, s))
    assert any(not src.is_contiguous() and src.shape != s for _, src, s in items)
    sync = WeightBroadcaster([EngineTarget(engine_proc, 1)], WeightSyncConfig(4096), True, "127.0.0.1",
                             _free_port(), 2, "gloo", group_name="wu_plans")
    sync.connect()
    client = EngineClient(engine_proc, timeout=120)
    try:
        for version in ("plans-1", "plans-2"):
            before = dict(sync._plans)
            out = sync.sync(iter(items), version=version)
            if version == "plans-2":  # same buckets: every plan object reused
                assert before and all(sync._plans[i] is p for i, p in before.items()), "plans rebuilt"
            assert out["weight_sync/buckets"] >= 3, out
            for name, src, s in items:
                got = torch.tensor(client.get_weights_by_name(name, truncate_size=10**6), dtype=torch.float32)
                assert torch.equal(got, src.reshape(s)), (version, name)
            assert client.get_model_info()["weight_version"] == version
            with torch.no_grad():  # the "optimizer step": in place, the sources are views of it
                for t in fused.values():
                    t.mul_(-0.5).add_(1.0)
    finally:
        sync.close()
        assert client.destroy_weights_update_group("wu_plans")["success"] is True
        client.close()
