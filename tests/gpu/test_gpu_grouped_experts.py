"""--moe-grouped-gemm on a GPU: bench/grouped_experts.py's side-by-side run of trainer/experts.py's GroupedExperts
and megatron's SequentialMLP (bf16, 64 local experts of 2048 -> 768, 16,384 tokens x top-8).

    pytest tests/gpu/test_gpu_grouped_experts.py -s

What must hold: the outputs, the input gradient and every weight gradient agree (on an H100, 2026-12-06, they
were identical: bench/results/grouped_experts_64x2048x768_1xH100_2026-12-06.json; bf16 GEMMs of another
accumulation order would differ by about 1e-2 relative, so 2e-2 is the bound), and the grouped forward and
backward is not slower than the per-expert loop (3.31x faster there).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_grouped_experts_equal_and_faster_than_sequential_on_the_gpu(tmp_path):
    out = tmp_path / "grouped.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "grouped_experts.py"), "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    print(proc.stdout[-2000:])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["dtype"] == "torch.bfloat16"
    assert max(r["relative_diff"].values()) <= 2e-2, r["relative_diff"]
    assert r["speedup"] >= 1.0, r["speedup"]
