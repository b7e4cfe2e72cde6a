"""ColocatedUpdater against an embedded engine: many small buckets through two reused shared-memory
buffers land bit-exactly (a buffer refilled too early would corrupt the previous bucket), a rank
without an engine only walks the iterator, and the metrics have the broadcaster's keys."""

from __future__ import annotations

import pytest
import torch
from engine_testlib import start_server
from safetensors.torch import load_file

from slime_rl.config import WeightSyncConfig
from slime_rl.engines.client import EngineClient
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
