"""The standalone weight-sync group: several ranks in threads of this process, gloo backend."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from slime_rl.engines import dist_group


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_broadcast_reaches_every_rank_without_a_default_group():
    port, world = _port(), 3
    got: dict[int, list[torch.Tensor]] = {}

    def rank(r: int) -> None:
        pg = dist_group.init_custom_group("127.0.0.1", port, r, world, "weight_update_group", "gloo")
        tensors = [torch.arange(6, dtype=torch.float32).reshape(2, 3) * (i + 1) if r == 0
                   else torch.zeros(2, 3) for i in range(2)]
        tensors.append(torch.tensor([1.5, -2.25], dtype=torch.bfloat16) if r == 0
                       else torch.zeros(2, dtype=torch.bfloat16))
        for t in tensors:
            dist_group.broadcast(pg, t, src=0)
        got[r] = tensors

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(got) == [0, 1, 2]
    for r in (1, 2):
        for a, b in zip(got[0], got[r], strict=True):
            assert torch.equal(a, b)
    assert got[2][1][1, 2].item() == 10.0
    assert not torch.distributed.is_initialized()


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="backend 'mpi'"):
        dist_group.init_custom_group("127.0.0.1", _port(), 0, 1, "g", "mpi")
    with pytest.raises(ValueError, match="outside world_size"):
        dist_group.init_custom_group("127.0.0.1", _port(), 2, 2, "g", "gloo")


def test_dtype_names_round_trip_as_sglang_sends_them():
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        name = dist_group.dtype_name(dt)
        assert getattr(torch, name) is dt  # SGLang resolves dtypes with getattr(torch, name)
        assert dist_group.dtype_from_name(name) is dt
        assert dist_group.dtype_from_name(str(dt)) is dt
    with pytest.raises(ValueError, match="'complex7'"):
        dist_group.dtype_from_name("complex7")


def test_meets_sglangs_own_group_on_the_same_store_keys(tmp_path):
    """Our trainer side (rank 0) against SGLang's engine side (`init_custom_process_group`), run in a
    subprocess because SGLang registers its group in torch.distributed's global state."""
    pytest.importorskip("sglang.srt.utils.common", reason="sglang is not installed")
    import subprocess
    import sys

    port = _port()
    script = tmp_path / "sglang_rank1.py"
    script.write_text(
        "import sys, torch\n"
        "from sglang.srt.utils.common import init_custom_process_group\n"
        "pg = init_custom_process_group(backend='gloo', init_method=f'tcp://127.0.0.1:{sys.argv[1]}',\n"
        "                               world_size=2, rank=1, group_name='weight_update_group')\n"
        "t = torch.zeros(4)\n"
        "torch.distributed.broadcast(t, src=0, group=pg)\n"
        "assert t.tolist() == [0.0, 2.0, 4.0, 6.0], t\n")
    proc = subprocess.Popen([sys.executable, str(script), str(port)])
    pg = dist_group.init_custom_group("127.0.0.1", port, 0, 2, "weight_update_group", "gloo")
    dist_group.broadcast(pg, torch.arange(4.0) * 2, src=0)
    assert proc.wait(timeout=120) == 0


def test_the_weight_update_store_listens_on_the_master_address_only():
    # all of 127.0.0.0/8 is loopback on Linux: host the group on 127.0.0.2 and probe 127.0.0.1, which a
    # store on every interface (torch's TCPStore given an address) answers
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
    got: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        pg = dist_group.init_custom_group("127.0.0.2", port, r, 2, "weight_update_group", "gloo")
        t = torch.full((3,), 7.0) if r == 0 else torch.zeros(3)
        if r == 0:
            with socket.socket() as probe:  # the store is up now (rank 0 has its group)
                probe.settimeout(2)
                got["probe"] = probe.connect_ex(("127.0.0.1", port))
        dist_group.broadcast(pg, t, src=0)
        got[r] = t

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert torch.equal(got[1], torch.full((3,), 7.0))  # the group works through the bound store
    assert got["probe"] != 0  # nothing listens on the other loopback address
    # the same probe against a store on every interface connects: the test can tell the two apart
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        open_port = s.getsockname()[1]
    from datetime import timedelta
    wide = torch.distributed.TCPStore("127.0.0.2", open_port, 1, is_master=True, timeout=timedelta(seconds=5))
    with socket.socket() as probe:
        probe.settimeout(2)
        assert probe.connect_ex(("127.0.0.1", open_port)) == 0
    del wide


def test_a_taken_store_address_names_itself():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            dist_group.init_custom_group("127.0.0.1", port, 0, 1, "g", "gloo")
