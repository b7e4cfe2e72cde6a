"""A standalone torch.distributed group for weight sync: one trainer rank (0) plus every engine rank.

The trainer process already has a default process group (Megatron's), and an engine process may have
its own; this group must not touch either. So it is built directly from a `TCPStore` and a backend
object (`ProcessGroupGloo` / `ProcessGroupNCCL`) and collectives are called on that object
(`group.broadcast([t], opts).wait()`): nothing is registered in torch.distributed's global state,
`dist.is_initialized()` stays what it was, and destroying the group is dropping the object.

Key layout. A real SGLang engine builds its end with `init_custom_process_group`
(python/sglang/srt/utils/common.py, SGLang 0.5.23): rendezvous on tcp://master_address:master_port
(rank 0 hosts the TCPStore; ours listens on master_address alone: `tcp_store`), then
`PrefixStore(group_name, store)`, and torch's
`_new_process_group_helper` adds `PrefixStore(f"{group_name}/")` and `PrefixStore(f"{device}/")`
("cpu" for gloo, "cuda" for nccl) before creating the backend. We build the same chain of prefixes,
so our trainer (rank 0) and a real SGLang engine meet on the same store keys, and our embedded engine
and slime-style trainers do too.

Ranks: the trainer is rank 0 and hosts the store; an engine's ranks are rank_offset + its local TP
rank (SGLang's weight_updater.py), so for N engines of TP t, world_size = 1 + N * t.
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # torch's default_pg_timeout, as SGLang uses


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: datetime.timedelta) -> dist.TCPStore:
    """A TCPStore whose server (`is_master`) listens on `host` alone. torch's TCPStore takes the address
    only to connect to; its server listens on every interface of the node. Here the socket is bound to
    `host` by us and its descriptor handed to the store, which owns it from then on (it closes it when
    it goes). Clients (`is_master` False) are plain TCPStores. Used by the weight-update group (below)
    and the trainer's rendezvous (trainer/parallel.py)."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise OSError(e.errno, f"the TCP store cannot listen on {host}:{port}: {e.strerror}") from e
        sock.listen(max(world_size, 128))
        store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes the descriptor itself
    return store


def _backend_store(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                   device: str, timeout: datetime.timedelta) -> dist.Store:
    store = tcp_store(master_address, master_port, world_size, rank == 0, timeout)
    store = dist.PrefixStore(group_name, store)
    store = dist.PrefixStore(f"{group_name}/", store)
    return dist.PrefixStore(f"{device}/", store)


def init_custom_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                      backend: str, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> object:
    """Join (rank > 0) or host (rank 0) the group; blocks until all `world_size` ranks have joined.

    backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors on the current CUDA device). Returns the
    backend object, to pass to `broadcast` and `destroy_group`.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if not group_name:
        raise ValueError("group_name: must not be empty")
    if backend == "gloo":
        store = _backend_store(master_address, master_port, rank, world_size, group_name, "cpu", timeout)
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        store = _backend_store(master_address, master_port, rank, world_size, group_name, "cuda", timeout)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"backend {backend!r}: expected 'gloo' or 'nccl'")


def broadcast(group: object, tensor: torch.Tensor, src: int) -> None:
    """In-place broadcast of `tensor` from group rank `src` to every rank of `group`."""
    broadcast_async(group, tensor, src).wait()


def broadcast_async(group: object, tensor: torch.Tensor, src: int) -> object:
    """Start the broadcast; returns its work. `work.wait()` makes the current CUDA stream wait for
    it (NCCL, no host sync) or blocks until done (gloo); `tensor` must not be touched before."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    return group.broadcast([tensor], opts)


def destroy_group(group: object) -> None:
    """Release the group's communicators without waiting for the other ranks.

    NCCL: `abort()` (ncclCommAbort) returns at once. Not `shutdown()`: its graceful finalize waited
    for the peer in our H200 test, and the engine answers /destroy_weights_update_group before the
    trainer destroys its end, so a waiting destroy deadlocks the two. Gloo closes when collected.
    """
    if isinstance(group, dist.ProcessGroupNCCL):
        group.abort()


_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "float64": torch.float64, "double": torch.float64, "int64": torch.int64,
    "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}


def dtype_from_name(name: str) -> torch.dtype:
    """SGLang sends dtypes as torch attribute names ("bfloat16", or "torch.bfloat16" from str(dtype))."""
    if not isinstance(name, str):
        raise ValueError(f"dtype {name!r}: expected a dtype name (a string)")
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype {name!r}: unknown (expected one of {sorted(_DTYPES)})")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """The name SGLang's `getattr(torch, name)` understands: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")
