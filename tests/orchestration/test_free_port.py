"""The ports the driver picks for engines, the router and the trainers' rendezvous: free, and outside
the kernel's ephemeral range, from which every outgoing connection takes its local port (a port picked
there was taken between the pick and the engine's bind in CI: "Address already in use")."""

from __future__ import annotations

import socket
from pathlib import Path

from slime_rl.orchestration.engines import free_port


def test_free_ports_are_bindable_and_below_the_ephemeral_range():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port("127.0.0.1") for _ in range(50)]
    assert all(1024 <= p < low for p in ports), (low, ports)
    assert len(set(ports)) > 40  # random, not the same port each time
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # still free


def test_a_port_taken_is_never_handed_out():
    taken = []
    for _ in range(200):  # hold many of the range's ports: none of them may come back
        s = socket.socket()
        s.bind(("127.0.0.1", free_port("127.0.0.1")))
        s.listen()
        taken.append(s)
    try:
        held = {s.getsockname()[1] for s in taken}
        assert not held & {free_port("127.0.0.1") for _ in range(200)}
    finally:
        for s in taken:
            s.close()
