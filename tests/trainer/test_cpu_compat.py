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


IMPORT_PROBE = """
import json, sys
import torch
compile_fn = torch.compile
import slime_rl.trainer.worker  # noqa: F401  (megatron through trainer/mcore.py)
import megatron.core.jit as jit
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu
x = torch.randn(3, 8, dtype=torch.float64)
b = torch.randn(8, dtype=torch.float64)
y1, y2 = torch.chunk(x + b, 2, -1)
expected = torch.nn.functional.silu(y1) * y2  # swiglu of the biased input, by hand
loggers = {m: m in sys.modules for m in ("wandb", "torch.utils.tensorboard")}
import megatron.core.timers as timers
import wandb  # noqa: F401  (importable as usual afterwards)
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor" in sys.modules,
                  "loggers_imported": loggers, "timers_writers": [timers.wandb is None, timers.SummaryWriter is None],
                  "wandb_later": "wandb" in sys.modules,
                  "jit_fuser_is_compile": jit.jit_fuser is compile_fn, "compile_restored": torch.compile is compile_fn,
                  "swiglu_eager_exact": bool(torch.equal(bias_swiglu(x, b), expected)),
                  "swiglu_is_plain_function": type(bias_swiglu).__name__ == "function"}))
"""


def test_megatron_imports_without_the_compiler_stack_or_the_logging_backends():
    """A rank process imports megatron without torch._dynamo / torch._inductor (1.5-2.7 s of CPU each):
    megatron's jit_fuser is bound to no compile, its fused functions run eagerly (a megatron fused swiglu
    equals the formula by hand, bit for bit), and torch.compile is torch's own again afterwards."""
    out = subprocess.run([sys.executable, "-c", IMPORT_PROBE], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r == {"dynamo": False, "inductor": False, "jit_fuser_is_compile": False, "compile_restored": True,
                 "swiglu_eager_exact": True, "swiglu_is_plain_function": True,
                 # megatron's timers import wandb and tensorboard for a writer the ranks never pass: not at
                 # a rank's start (trainer/mcore.py), and both import as usual afterwards
                 "loggers_imported": {"wandb": False, "torch.utils.tensorboard": False},
                 "timers_writers": [True, True], "wandb_later": True}


def test_the_engine_actor_module_does_not_import_torch():
    """The engine actor only builds and runs the engine's command line: its module must not pay for torch
    and transformers (the server process imports them)."""
    code = "import sys, slime_rl.orchestration.engines; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "False"]
