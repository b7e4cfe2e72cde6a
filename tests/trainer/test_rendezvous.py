"""The trainer's rendezvous store listens on the master address alone, not on every interface."""

from __future__ import annotations

import socket
from datetime import timedelta

from slime_rl.trainer.parallel import rendezvous_store


def test_store_binds_the_master_address_only():
    # all of 127.0.0.0/8 is loopback on Linux: bind the store to 127.0.0.2 and probe 127.0.0.1, which a
    # store listening on every interface (torch's tcp:// init) would answer
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
    store = rendezvous_store(0, 1, "127.0.0.2", port, timedelta(seconds=5))
    store.set("k", "v")
    client = rendezvous_store(1, 1, "127.0.0.2", port, timedelta(seconds=5))
    assert client.get("k") == b"v"
    with socket.socket() as probe:
        probe.settimeout(2)
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    # the same probe against a store on every interface connects: the test can tell the two apart
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        open_port = s.getsockname()[1]
    import torch.distributed as dist

    wide = dist.TCPStore("127.0.0.2", open_port, 1, is_master=True, timeout=timedelta(seconds=5))
    with socket.socket() as probe:
        probe.settimeout(2)
        assert probe.connect_ex(("127.0.0.1", open_port)) == 0
    del wide
