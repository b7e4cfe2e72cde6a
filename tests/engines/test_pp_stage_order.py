"""#17 row 4: with PP=2 every stage syncs its own group; an engine serves one weight-update call at a
time (SGLang's lock, held for the whole call), so two engines reached by the stages in crossed orders
deadlock unless the stages take turns. Scenario: pp_stage_scenario.py (gloo, PP=2, 2 engines).

On gloo the hang reproduces in the groups' rendezvous (/init_weights_update_group: each member waits
for all); a gloo broadcast is the root sending to each rank directly, so crossed update calls alone
still finish here (measured: connect in turns, sync at once, completes). With NCCL the broadcast
itself needs every rank (ring/tree), so on GPUs the crossed syncs hang too; the turns cover both."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_testlib import start_server
from pp_stage_scenario import run

from slime_rl.engines.client import EngineClient

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engines(tiny_qwen2):
    servers = [start_server(tiny_qwen2, random_seed=i) for i in range(2)]
    yield servers
    for s in servers:
        s.shutdown()


def test_pp2_stages_in_one_order_sync_two_engines_reached_in_crossed_orders(engines):
    sent = run(engines, serialize=True)  # old code (stages at once): hangs, see the next test
    for e in engines:
        with EngineClient(e.url, timeout=60) as c:
            assert c.get_model_info()["weight_version"] == "pp-1"
            for name, t in sent[0][:2] + sent[1][-2:]:  # both stages' tensors landed
                got = torch.tensor(c.get_weights_by_name(name, truncate_size=10**6), dtype=torch.float32)
                assert torch.equal(got, t), name


def test_pp2_stages_at_once_deadlock_on_the_engine_lock(tiny_qwen2):
    """The same scenario without the turns (what the trainer did before) never finishes: the
    built-in engine reproduces SGLang's deadlock. In a child process, killed after the wait."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.engines.pp_stage_scenario", str(tiny_qwen2), "concurrent"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    try:
        for line in proc.stdout:  # model loading logs first
            if line.strip() == "engines up":
                break
        else:
            pytest.fail("the scenario's engines did not start")
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=10)  # the serialized run takes about 2 s of delays plus the sends
    finally:
        proc.kill()
        out = proc.communicate()[0]
    assert "synced" not in out
