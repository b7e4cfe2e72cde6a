"""Checks shared by the CPU and GPU end-to-end tests."""

from __future__ import annotations

import numpy as np
import pytest

from slime_rl.engines.client import EngineClient


def digit_data_fixture(n: int, seed: int):
    """A module-scoped fixture `digit_data`: a jsonl of `n` copy-a-digit prompts (quickstart task)."""
    @pytest.fixture(scope="module")
    def digit_data(tmp_path_factory):
        from slime_rl.data.digits import make_rows, write_jsonl

        return write_jsonl(make_rows(n, seed=seed), tmp_path_factory.mktemp("data") / "digits.jsonl")
    return digit_data


def one_step_then_compare_weights(cluster, api_key: str, version: str = "1") -> dict[str, np.ndarray]:
    """Start the cluster, run generate/train/sync once, and assert that every engine holds every
    tensor the trainer gathered, bit for bit. Returns the trainer's tensors."""
    cluster.start(train_iters=2)
    cluster.generate(0)
    cluster.train(0)
    cluster.sync_weights(version=version)
    return compare_engine_weights(cluster, api_key, version)


def compare_engine_weights(cluster, api_key: str, version: str) -> dict[str, np.ndarray]:
    """Assert that every engine holds weight version `version` and every tensor the trainer gathers,
    bit for bit. Returns the trainer's tensors."""
    trainer = cluster.trainers.hf_weights()
    for url in cluster.engine_urls:
        with EngineClient(url, api_key=api_key) as client:
            assert client.get_model_info()["weight_version"] == version
            for name, expected in trainer.items():
                got = np.asarray(client.get_weights_by_name(name, truncate_size=10**9), dtype=np.float32)
                assert got.size == expected.size, name
                assert np.array_equal(got.reshape(-1), expected.reshape(-1)), name  # exact, not approximately
    return trainer
