"""The launch scripts' node helpers (slime_rl/orchestration/nodes.py): the head's wait for its workers
against a scripted node list, then the command against a real local Ray head with a short timeout; a
worker's wait for the head's port; the run-over key the head sets and the workers poll; the head's
IPv4 address."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from slime_rl.orchestration.nodes import (
    RELEASE_KEY,
    HeadUnreachable,
    NoAddress,
    NodesMissing,
    node_ipv4,
    release,
    until_released,
    wait_for_nodes,
    wait_reachable,
)

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


def test_the_wait_stops_when_the_heads_ray_start_exits():
    with pytest.raises(NodesMissing, match=r"1 of 2 Ray nodes joined the head before this node's `ray start` exited"):
        wait_for_nodes(2, timeout_s=60, nodes=lambda: [node("10.0.0.1")], poll_s=0.01, alive=lambda: False)


def test_a_worker_waits_for_the_heads_port():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        wait_reachable(f"127.0.0.1:{server.getsockname()[1]}", timeout_s=5)
        closed = server.getsockname()[1]
    with pytest.raises(HeadUnreachable) as err:
        wait_reachable(f"127.0.0.1:{closed}", timeout_s=0.3, poll_s=0.1)
    assert f"the Ray head at 127.0.0.1:{closed} did not answer within 0.3 s" in str(err.value)
    assert "HEAD_WAIT_TIMEOUT" in str(err.value)


class FakeGcs:
    """The two GCS calls the helpers make: the key-value store and the node table."""

    def __init__(self, kv_answers=(), nodes_alive=(1,)):
        self.kv_answers, self.nodes_alive, self.put = list(kv_answers), list(nodes_alive), []

    def internal_kv_get(self, key, namespace, timeout=None):
        answer = self.kv_answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def internal_kv_put(self, key, value, overwrite, namespace, timeout=None):
        self.put.append((namespace, key, value))

    def get_all_node_info(self, timeout=None):
        from ray.core.generated.gcs_pb2 import GcsNodeInfo

        alive = self.nodes_alive.pop(0) if len(self.nodes_alive) > 1 else self.nodes_alive[0]
        return {i: GcsNodeInfo(state=GcsNodeInfo.ALIVE if i < alive else GcsNodeInfo.DEAD) for i in range(3)}


def test_the_head_releases_the_workers_and_waits_until_they_left():
    gcs = FakeGcs(nodes_alive=[3, 2, 1])
    assert release("h:1", timeout_s=10, poll_s=0.01, client=gcs) == 0
    assert gcs.put == [(RELEASE_KEY[0], RELEASE_KEY[1], b"1")] and gcs.nodes_alive == [1]
    stuck = FakeGcs(nodes_alive=[3])
    assert release("h:1", timeout_s=0.05, poll_s=0.01, client=stuck) == 2  # the head stops anyway, saying so


def test_a_worker_leaves_when_released_when_the_head_is_gone_or_its_node_is():
    assert until_released("h:1", poll_s=0.01, client=FakeGcs([None, None, b"1"])) == "released"
    gone = FakeGcs([None] + [RuntimeError("Timed out while waiting for GCS")] * 100)
    assert until_released("h:1", poll_s=0.01, head_gone_s=0.1, client=gone) == "head gone"
    assert until_released("h:1", poll_s=0.01, alive=lambda: False, client=FakeGcs([None])) == "node gone"


def test_the_heads_address_is_a_non_loopback_ipv4_one():
    # Debian's 127.0.1.1 for the host's own name, an IPv6 entry first: skipped, the next real IPv4 address used
    assert node_ipv4("n1", resolve=lambda h: ["127.0.1.1", "fe80::1", "10.0.0.5"], this_host=False) == \
        ("10.0.0.5", "n1 resolves to it")
    # only loopback, on the head itself: its default-route address, else its first real interface address
    ip, how = node_ipv4("n1", resolve=lambda h: ["127.0.1.1"], this_host=True, route_source=lambda: "192.168.1.9")
    assert ip == "192.168.1.9" and "n1 resolves to 127.0.1.1" in how and "default-route" in how
    ip, _ = node_ipv4("n1", resolve=lambda h: ["127.0.1.1"], this_host=True, route_source=lambda: None,
                      interfaces=lambda: ["127.0.0.1", "169.254.3.3", "172.16.0.2"])
    assert ip == "172.16.0.2"
    # nothing usable: an error naming what was found and MASTER_ADDR
    with pytest.raises(NoAddress, match=r"head node n1 \(n1 resolves to 127.0.1.1; it is not this machine\); "
                                        r"set MASTER_ADDR"):
        node_ipv4("n1", resolve=lambda h: ["127.0.1.1"], this_host=False)
    with pytest.raises(NoAddress, match="n2 does not resolve"):
        node_ipv4("n2", resolve=lambda h: [], this_host=True, route_source=lambda: "127.0.0.1",
                  interfaces=lambda: ["127.0.0.1"])


def test_against_a_local_ray_head(ray_session):
    """The shared test Ray session is the head the subprocess joins."""
    import ray

    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}

    def nodes(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "slime_rl.orchestration.nodes", "--address", address, *args],
                              capture_output=True, text=True, env=env, timeout=300)

    def wait(n: int) -> subprocess.CompletedProcess:
        return nodes("--nodes", str(n), "--timeout", "1", "--poll", "0.2")

    short = wait(2)
    assert short.returncode == 1, short.stderr
    assert f"1 of 2 Ray nodes joined the head at {address} within 1 s" in short.stderr
    enough = wait(1)
    assert enough.returncode == 0, enough.stderr
    assert "1 Ray nodes joined" in enough.stdout
    # the run-over key through Ray's own GCS client: set by the head, seen by a worker at its first poll
    released = nodes("--release", "--timeout", "5")
    assert released.returncode == 0 and "the run is over; the other nodes have left" in released.stdout, released.stderr
    seen = nodes("--until-released", "--poll", "0.2")
    assert seen.returncode == 0 and f"the run on the head at {address} is over" in seen.stdout, seen.stderr
