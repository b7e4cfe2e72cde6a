"""ColocatedUpdater against an embedded engine: many small buckets through two reused shared-memory
buffers land bit-exactly (a buffer refilled too early would corrupt the previous bucket), a rank
without an engine only walks the iterator, and the metrics have the broadcaster's keys."""

from __future__ import annotations

import pytest
import torch
from engine_testlib import start_server
from safetensors.torch import load_file

from slime_rl.config import WeightSyncConfig
from slime_rl.engines.client import EngineClient, EngineError
from slime_rl.weight_sync.broadcast import EngineTarget
from slime_rl.weight_sync.colocated import MEMORY_TAGS, ColocatedUpdater


@pytest.fixture(scope="module")
def engine(tiny_qwen2):
    s = start_server(tiny_qwen2, random_seed=3)
    yield s
    s.shutdown()


def test_many_buckets_land_bit_exactly_after_a_release(engine, tiny_qwen2):
    named = [(n, (t.float() * 1.5 + 0.25)) for n, t in sorted(load_file(f"{tiny_qwen2}/model.safetensors").items())]
    total = sum(t.numel() * t.element_size() for _, t in named)
    updater = ColocatedUpdater([EngineTarget(engine.url, 0)], mine=[0], cfg=WeightSyncConfig(3000))
    client = EngineClient(engine.url)
    try:
        client.release_memory_occupation(MEMORY_TAGS)
        client.resume_memory_occupation(MEMORY_TAGS)
        metrics = updater.sync(iter(named), version="7")
        assert metrics["weight_sync/bytes"] == total and metrics["weight_sync/buckets"] > 4
        assert {"weight_sync/seconds", "weight_sync/build_seconds", "weight_sync/fill_seconds",
                "weight_sync/http_wait_seconds"} <= set(metrics)
        for name, expected in named:
            got = torch.tensor(client.get_weights_by_name(name, truncate_size=10**9))
            assert torch.equal(got.view(-1), expected.view(-1)), name
        assert client.get_model_info()["weight_version"] == "7"
        assert client.generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0})["meta_info"]["weight_version"] == "7"
        assert updater._buffers == [None, None]  # freed after the sync: the device belongs to the engine
    finally:
        updater.close()
        client.close()


def test_a_rank_without_an_engine_only_walks_the_gathers():
    walked = []

    def gen():
        for i in range(3):
            walked.append(i)
            yield f"t{i}", torch.zeros(2)

    updater = ColocatedUpdater([EngineTarget("http://127.0.0.1:9", 0)], mine=[], cfg=WeightSyncConfig(8))
    assert updater.sync(gen(), version="1") == {} and walked == [0, 1, 2] and not updater.is_source
    updater.close()


def test_an_engine_of_two_devices_reads_the_first_of_two_equal_entries(tiny_qwen2):
    """--colocated-devices 2: one entry per device, each made by the trainer rank beside it; the built-in
    engine (no tensor parallel) copies entry 0. In a sync every trainer rank holds the full tensors, so
    the entries are equal; on CPU the engine checks it and refuses entries that differ (nothing copied)."""
    from slime_rl.engines.tensor_ipc import serialize_named_tensors, use_file_system_sharing

    server = start_server(tiny_qwen2, random_seed=3, colocated_devices=2)
    client = EngineClient(server.url)
    use_file_system_sharing()
    norm = torch.tensor(client.get_weights_by_name("model.norm.weight", truncate_size=10**9))

    def entry(scale: float) -> str:
        return serialize_named_tensors([("model.norm.weight", (norm * scale).share_memory_())])

    def update(*entries: str):
        client.open_weight_update_session()
        try:
            return client._call("POST", "/update_weights_from_tensor", {"serialized_named_tensors": list(entries)})
        finally:
            client.close_weight_update_session()

    try:
        assert client.get_server_info()["colocated_devices"] == 2
        with pytest.raises(EngineError, match=r"expected 2 entries .*--colocated-devices 2\), got 1"):
            update(entry(2.0))
        with pytest.raises(EngineError, match=r"serialized_named_tensors\[1\] does not hold the same tensors"):
            update(entry(2.0), entry(3.0))
        assert torch.equal(torch.tensor(client.get_weights_by_name("model.norm.weight", truncate_size=10**9)), norm)
        update(entry(2.0), entry(2.0))
        assert torch.equal(torch.tensor(client.get_weights_by_name("model.norm.weight", truncate_size=10**9)),
                           norm * 2.0)
    finally:
        client.close()
        server.shutdown()
