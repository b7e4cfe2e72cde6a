"""Which decode path the built-in engine takes (server.decodes_on_slots).

On an H200 (BENCHMARKS.md, 2026-12-03): with --enable-deterministic-inference and --disable-cuda-graph the engine
decoded on the dynamic path, where the deterministic flash decode does not run, and the loop's bf16
gap rose from 3e-5 to 2e-2. Deterministic inference on CUDA keeps the slot path with graphs off.
The table below is the rule written out by hand, not read from the function."""

import pytest

from slime_rl.engines.embedded.server import decodes_on_slots

CASES = [
    # device, disable_cuda_graph, static_kv_cache, deterministic -> slot path
    ("cuda", False, False, False, True),   # graphs on the slot cache: the CUDA default
    ("cuda", True, False, False, False),   # graphs off: the dynamic path, as before
    ("cuda", True, False, True, True),     # graphs off, deterministic: its flash decode needs the slots
    ("cuda", True, True, False, True),     # graphs off, --static-kv-cache asked for
    ("cpu", False, False, False, False),   # CPU default: dynamic
    ("cpu", False, False, True, False),    # CPU deterministic: no flash decode there, stays dynamic
    ("cpu", False, True, False, True),     # --static-kv-cache on CPU
    ("cuda:1", True, False, True, True),   # a device index is still CUDA
]


@pytest.mark.parametrize("device,no_graph,static,det,expected", CASES)
def test_decode_path(device, no_graph, static, det, expected):
    assert decodes_on_slots(device, no_graph, static, det) is expected
