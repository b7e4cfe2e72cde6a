"""One test per cpu_compat patch: the call fails without the patch and works with it.

The patches change global torch state, so they run in a fresh process (cpu_compat_probe.py) and
each test reads its part of that process's report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is a no-op with CUDA")


@pytest.fixture(scope="module")
def report() -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.trainer.cpu_compat_probe"], cwd=ROOT,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_paged_stash_stub_lets_megatron_import_without_triton(report):
    r = report["paged_stash"]
    assert r["before"] is not None and "triton" in r["before"]
    assert r["after_error"] is None


def test_rng_tracker_fork_uses_cpu_generator(report):
    r = report["rng"]
    assert r["before"] is not None  # CudaRNGStatesTracker.add reads the CUDA generator
    assert r["after_error"] is None
    assert r["same_seed_same_draw"] and r["other_seed_differs"]
    assert r["default_state_restored"]  # fork() leaves the surrounding random stream untouched


def test_current_device_is_cpu(report):
    r = report["current_device"]
    assert r["before"] is not None
    assert r["after_error"] is None and r["device"] == "cpu"


def test_device_mode_maps_cuda_to_cpu_and_passes_type_asserts(report):
    r = report["device_mode"]
    assert r["before"] is not None and r["before"].startswith("AssertionError")  # grad.type() assert
    assert r["before_alloc"] is not None
    assert r["after_error"] is None
    assert r["clipped_grad"] == pytest.approx(2.0 * 1.0 / (10.0 + 1e-6))  # grads scaled by max/total
    assert r["alloc_device"] == r["to_cuda"] == "cpu" and r["cuda_is_self"]
    assert r["type"] == "torch.cuda.FloatTensor" and r["cast"]
    assert r["stack_depth_stable"]  # apply() twice pushes one mode


def test_streams_and_events_are_noops(report):
    r = report["streams"]
    assert r["before"] is not None
    assert r["after_error"] is None and r["ok"] is True


def test_moe_split_sizes_become_numpy(report):
    r = report["moe_splits"]
    assert r["before"] == "Tensor"  # megatron converts only CUDA tensors
    assert r["after"] == "ndarray" and r["values"] == [3, 1] and r["tensor_kept"]


def test_apply_is_idempotent_and_complete(report):
    assert report["applied"] == ["current_device", "device_mode", "moe_splits", "paged_stash", "rng", "streams",
                                 "uneven_collectives"]


def test_on_rank_thread_gives_another_thread_the_device_mode(report):
    r = report["on_rank_thread"]
    assert r["plain_error"] is not None  # the mode pushed on the main thread does not reach others
    assert r["generator"] == r["decorated"] == "cpu"
