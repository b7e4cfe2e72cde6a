"""Fixtures of the GPU tests: a module-scoped Ray instance on 1 or 2 GPUs (skipped without them, NVLink
multicast off as the device notes ask), and the 4-layer hidden-256 tiny Qwen2 they train."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch


def _ray_on(gpus: int) -> Iterator[None]:
    import ray

    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPU(s)")
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    ray.init(num_cpus=8, num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_gpu() -> Iterator[None]:
    yield from _ray_on(2)


@pytest.fixture(scope="module")
def ray_one_gpu() -> Iterator[None]:
    yield from _ray_on(1)


@pytest.fixture(scope="module")
def wider_model(tmp_path_factory):
    from tests.conftest import _load_tool

    return _load_tool("make_tiny_model").make_tiny_model(tmp_path_factory.mktemp("m256"), hidden_size=256,
                                                         num_layers=4, num_heads=8, num_kv_heads=2)
