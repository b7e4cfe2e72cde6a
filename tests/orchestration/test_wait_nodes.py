"""launch/ray_multi_node.sh's wait for its workers (slime_rl/orchestration/nodes.py): the polling logic
against a scripted node list, then the command against a real local Ray head with a short timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime_rl.orchestration.nodes import NodesMissing, wait_for_nodes

ROOT = Path(__file__).resolve().parents[2]


def node(ip: str, gpus: int = 8) -> dict:
    return {"Alive": True, "NodeManagerAddress": ip, "Resources": {"GPU": float(gpus), "CPU": 16.0}}


def test_returns_once_the_workers_have_joined():
    answers = iter([[node("10.0.0.1")], [node("10.0.0.1")], [node("10.0.0.1"), node("10.0.0.2")]])
    calls = []

    def nodes():
        calls.append(1)
        return next(answers)

    joined = wait_for_nodes(2, timeout_s=30, nodes=nodes, poll_s=0.01)
    assert [n["NodeManagerAddress"] for n in joined] == ["10.0.0.1", "10.0.0.2"] and len(calls) == 3


def test_timeout_names_who_joined_and_what_to_run():
    with pytest.raises(NodesMissing) as err:
        wait_for_nodes(3, timeout_s=0.2, nodes=lambda: [node("10.0.0.1"), node("10.0.0.2", 4)], poll_s=0.05,
                       address="the head at 10.0.0.1:6379")
    text = str(err.value)
    assert "2 of 3 Ray nodes joined the head at 10.0.0.1:6379 within 0.2 s" in text
    assert "10.0.0.1 (8 GPUs), 10.0.0.2 (4 GPUs)" in text
    assert "NODE_RANK=<1..2> bash launch/ray_multi_node.sh" in text and "NODE_WAIT_TIMEOUT" in text


def test_against_a_local_ray_head(ray_session):
    """The shared test Ray session is the head the subprocess joins."""
    import ray

    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}

    def wait(n: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "slime_rl.orchestration.nodes", "--address", address,
                               "--nodes", str(n), "--timeout", "1", "--poll", "0.2"],
                              capture_output=True, text=True, env=env, timeout=300)

    short = wait(2)
    assert short.returncode == 1, short.stderr
    assert f"1 of 2 Ray nodes joined the head at {address} within 1 s" in short.stderr
    enough = wait(1)
    assert enough.returncode == 0, enough.stderr
    assert "1 Ray nodes joined" in enough.stdout
