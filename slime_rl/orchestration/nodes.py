"""The launch scripts' node helpers (`launch/ray_multi_node.sh`, `launch/slurm_example.sbatch`):

    python -m slime_rl.orchestration.nodes --address HEAD_IP:6379 --nodes 2 [--timeout 600] [--watch-pid PID]
    python -m slime_rl.orchestration.nodes --address HEAD_IP:6379 --reachable [--timeout 600]
    python -m slime_rl.orchestration.nodes --address HEAD_IP:6379 --until-released [--watch-pid PID]
    python -m slime_rl.orchestration.nodes --address HEAD_IP:6379 --release [--timeout 30]
    python -m slime_rl.orchestration.nodes --ipv4-of HOST

`--nodes N`: the head waits until N nodes (itself included) are alive before the driver starts, so a
run never starts (and fails its placement) on a half-joined cluster. Exit status 0 once they are; 1
with a message naming who joined and what to run when the timeout passes first (or when the process
`--watch-pid` names, the head's `ray start`, exits); 2 when the head cannot be reached.

`--reachable`: a worker waits until the head's port answers before it runs `ray start --address`
(exit 1 after the timeout, naming the head's address).

`--until-released` (a worker, once its node has joined) and `--release` (the head, once the run has ended):
the nodes leave in order. The head sets a key in the cluster's key-value store (the GCS's) and waits
until the other nodes have left (at most `--timeout` seconds) before it stops its own node; each worker
polls the key and stops its node when it is set. A node stopped while the head is still up stops at
once; one whose head went first keeps Ray's agents for a minute (they wait for the GCS to come back).
`--until-released` exits 0 when released, 1 when the head has been unreachable for 15 s or the process
`--watch-pid` names (the node's `ray start`) exited.

`--ipv4-of HOST`: prints a non-loopback IPv4 address of HOST (the head node), the address the other
nodes are given: one HOST resolves to, else, when HOST is this machine, the source address of its
default route or of its first interface. Never a loopback address (Debian maps a host's own name to
127.0.1.1) and never IPv6 (`getent hosts` may list it first). Exit status 1 with a message when
there is none.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from slime_rl.engines import addresses


class NodesMissing(RuntimeError):
    """Fewer nodes joined than expected before the timeout; the message says which and what to do."""


class HeadUnreachable(RuntimeError):
    """The head's port did not answer before the timeout; the message names the address."""


# the key the head sets when the run is over (namespace, key), in the GCS's key-value store
RELEASE_KEY = (b"slime_rl", b"launch_run_over")
HEAD_GONE_S = 15.0


class NoAddress(RuntimeError):
    """No non-loopback IPv4 address for the head; the message says what was found and what to set."""


def alive_nodes() -> list[dict]:
    """The alive nodes of the cluster this process is connected to (ray.nodes() entries)."""
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def gpu_shape(nodes: list[dict]) -> tuple[int, int]:
    """(nodes with GPUs, GPUs of each) of a Ray cluster's alive nodes (`ray.nodes()` entries): what a run on
    that cluster is planned for. Nodes without GPUs (a CPU-only head) hold no bundle of a GPU plan; nodes of
    unequal GPU counts count as the smallest. (1, 0) for a cluster without GPUs."""
    gpus = [int(n.get("Resources", {}).get("GPU", 0)) for n in nodes]
    gpus = [g for g in gpus if g > 0]
    return (len(gpus), min(gpus)) if gpus else (1, 0)


def ray_init(**kwargs: Any) -> None:
    """ray.init(**kwargs), keeping the driver's SIGTERM handler: ray.init installs a crash handler for SIGTERM
    (it prints "*** SIGTERM received" and aborts, exit 134); the driver's own (train.main: unwind, one
    sentence, exit 143) goes back. Nothing when Ray is initialized."""
    import signal
    import threading

    import ray

    if ray.is_initialized():
        return
    main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main else None
    ray.init(**kwargs)
    if main and callable(sigterm):
        signal.signal(signal.SIGTERM, sigterm)


def join_cluster(address: str) -> None:
    """Join the Ray cluster at `address` (`ray_init`: the driver keeps its SIGTERM handler)."""
    ray_init(address=address)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_for_nodes(expected: int, timeout_s: float, nodes: Callable[[], list[dict]] = alive_nodes,
                   poll_s: float = 2.0, address: str = "the head",
                   alive: Callable[[], bool] = lambda: True) -> list[dict]:
    """Poll `nodes()` until `expected` nodes are alive; returns them, or raises NodesMissing after
    `timeout_s` seconds, or as soon as `alive()` is false (the message lists the nodes that joined
    and their GPUs)."""
    if expected < 1:
        raise ValueError(f"--nodes must be >= 1, got {expected}")
    deadline = time.monotonic() + timeout_s
    seen: list[dict] = []
    gone = False
    while True:
        seen = nodes()
        if len(seen) >= expected:
            return seen
        if not alive():
            gone = True
            break
        if time.monotonic() >= deadline:
            break
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
    joined = ", ".join(f"{n.get('NodeManagerAddress', '?')} ({int(n.get('Resources', {}).get('GPU', 0))} GPUs)"
                       for n in seen) or "none"
    when = "before this node's `ray start` exited (its output above says why)" if gone else \
        f"within {timeout_s:g} s"
    raise NodesMissing(
        f"{len(seen)} of {expected} Ray nodes joined {address} {when} (joined: {joined}); start "
        f"the missing ones with MASTER_ADDR=<head ip> NODE_RANK=<1..{expected - 1}> bash launch/ray_multi_node.sh, "
        "check that they reach the head's port, or raise NODE_WAIT_TIMEOUT")


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--address must be HOST:PORT, got {address!r}")
    return host, int(port)


def wait_reachable(address: str, timeout_s: float, poll_s: float = 1.0, what: str = "HEAD_WAIT_TIMEOUT",
                   alive: Callable[[], bool] = lambda: True,
                   connect: Callable[..., socket.socket] = socket.create_connection) -> None:
    """Until a TCP connection to `address` (HOST:PORT) succeeds; raises HeadUnreachable after `timeout_s`
    seconds (one attempt when it is 0) or as soon as `alive()` is false."""
    host, port = split_address(address)
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        try:
            connect((host, port), timeout=max(0.5, min(5.0, poll_s))).close()
            return
        except OSError as exc:
            last = exc
        if not alive():
            raise HeadUnreachable(f"this node's `ray start` exited before the Ray head at {address} answered "
                                  "(its output above says why)")
        if time.monotonic() >= deadline:
            break
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
    raise HeadUnreachable(
        f"the Ray head at {address} did not answer within {timeout_s:g} s ({last}); start the head first "
        f"(NODE_RANK=0), check MASTER_ADDR and that this node reaches the head's port, or raise {what}")


def gcs_client(address: str):
    """A client of the head's GCS without joining the cluster as a driver (what `ray status` uses)."""
    from ray._raylet import GcsClient

    return GcsClient(address=address)


def release(address: str, timeout_s: float, poll_s: float = 0.5, client=None) -> int:
    """Tell the other nodes the run is over, then wait (at most `timeout_s`) until only this one is alive.
    Returns the number of other nodes still alive."""
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    c = client if client is not None else gcs_client(address)
    c.internal_kv_put(RELEASE_KEY[1], b"1", True, RELEASE_KEY[0], timeout=10)
    deadline = time.monotonic() + timeout_s
    while True:
        others = sum(n.state == GcsNodeInfo.ALIVE for n in c.get_all_node_info(timeout=10).values()) - 1
        if others <= 0 or time.monotonic() >= deadline:
            return max(others, 0)
        time.sleep(poll_s)


def until_released(address: str, poll_s: float = 2.0, alive: Callable[[], bool] = lambda: True,
                   head_gone_s: float = HEAD_GONE_S, client=None) -> str:
    """Poll the head's key until it is set ("released"), the head has not answered for `head_gone_s`
    ("head gone") or `alive()` is false ("node gone")."""
    c = client if client is not None else gcs_client(address)
    last_answer = time.monotonic()
    while True:
        try:
            if c.internal_kv_get(RELEASE_KEY[1], RELEASE_KEY[0], timeout=min(5.0, head_gone_s)):
                return "released"
            last_answer = time.monotonic()
        except Exception:  # ray.exceptions.RpcError and its kin: the GCS did not answer
            if time.monotonic() - last_answer >= head_gone_s:
                return "head gone"
        if not alive():
            return "node gone"
        time.sleep(poll_s)


def _interface_ipv4() -> list[str]:
    import psutil

    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET]


def _is_this_host(host: str) -> bool:
    names = {socket.gethostname(), socket.gethostname().split(".")[0], socket.getfqdn(), "localhost"}
    return host in names or host.split(".")[0] in names


def node_ipv4(host: str, resolve: Callable[[str], list[str]] | None = None, this_host: bool | None = None,
              route_source: Callable[[], str | None] = addresses.route_source,
              interfaces: Callable[[], list[str]] = _interface_ipv4) -> tuple[str, str]:
    """A non-loopback IPv4 address of `host` and how it was found. Raises NoAddress naming what was seen."""
    if resolve is None:
        def resolve(name: str) -> list[str]:
            try:
                return list(dict.fromkeys(ai[4][0] for ai in socket.getaddrinfo(name, None, socket.AF_INET)))
            except OSError:
                return []
    resolved = resolve(host)
    for ip in resolved:
        if addresses.usable(ip):
            return ip, f"{host} resolves to it"
    skipped = f"{host} resolves to {', '.join(resolved)}" if resolved else f"{host} does not resolve"
    if this_host is None:
        this_host = _is_this_host(host)
    if this_host:
        src = route_source()
        if src and addresses.usable(src):
            return src, f"{skipped}: this machine's default-route address"
        for ip in interfaces():
            if addresses.usable(ip):
                return ip, f"{skipped}: this machine's first non-loopback interface address"
    raise NoAddress(f"no non-loopback IPv4 address for the head node {host} ({skipped}"
                    f"{'' if this_host else '; it is not this machine'}); set MASTER_ADDR=<head ip>")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slime_rl.orchestration.nodes", description=__doc__.splitlines()[0])
    p.add_argument("--address", help="the head's Ray address, HOST:PORT")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--nodes", type=int, help="nodes the cluster must have, the head included")
    mode.add_argument("--reachable", action="store_true", help="wait until the head's port answers")
    mode.add_argument("--until-released", action="store_true",
                      help="(a worker) wait until the head says the run is over")
    mode.add_argument("--release", action="store_true",
                      help="(the head) say the run is over and wait until the other nodes have left")
    mode.add_argument("--ipv4-of", metavar="HOST", help="print a non-loopback IPv4 address of HOST")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (default 600)")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between checks")
    p.add_argument("--watch-pid", type=int, help="stop waiting when this process (the head's `ray start`) exits")
    a = p.parse_args(argv)
    alive = (lambda: pid_alive(a.watch_pid)) if a.watch_pid else (lambda: True)
    if a.ipv4_of:
        try:
            ip, how = node_ipv4(a.ipv4_of)
        except NoAddress as exc:
            print(f"slime-rl: {exc}", file=sys.stderr)
            return 1
        print(f"slime-rl: head node {a.ipv4_of}: {ip} ({how})", file=sys.stderr)
        print(ip)
        return 0
    if not a.address:
        p.error("--address is required with --nodes, --reachable, --until-released and --release")
    if a.release:
        try:
            left = release(a.address, a.timeout)
        except Exception as exc:  # the head's GCS is gone already: nothing to tell
            print(f"slime-rl: could not tell the other nodes that the run is over ({exc})", file=sys.stderr)
            return 1
        print("slime-rl: the run is over; " + (f"{left} other node(s) still joined after {a.timeout:g} s, stopping the "
                                                "head anyway" if left else "the other nodes have left"), flush=True)
        return 0
    if a.until_released:
        how = until_released(a.address, poll_s=a.poll, alive=alive)
        if how == "released":
            print(f"slime-rl: the run on the head at {a.address} is over: stopping this node", flush=True)
            return 0
        print(f"slime-rl: the Ray head at {a.address} has not answered for {HEAD_GONE_S:g} s: stopping this node"
              if how == "head gone" else "slime-rl: this node's `ray start` exited (its output above says why)",
              file=sys.stderr)
        return 1
    try:
        wait_reachable(a.address, a.timeout, poll_s=min(a.poll, 1.0), alive=alive,
                       what="HEAD_WAIT_TIMEOUT" if a.reachable else "NODE_WAIT_TIMEOUT")
    except HeadUnreachable as exc:
        print(f"slime-rl: {exc}", file=sys.stderr)
        return 1 if a.reachable else 2
    except ValueError as exc:
        p.error(str(exc))
    if a.reachable:
        print(f"slime-rl: the Ray head at {a.address} answers", flush=True)
        return 0
    import ray

    try:
        ray.init(address=a.address, logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        print(f"slime-rl: cannot reach the Ray head at {a.address}: {exc}", file=sys.stderr)
        return 2
    try:
        joined = wait_for_nodes(a.nodes, a.timeout, poll_s=a.poll, address=f"the head at {a.address}", alive=alive)
    except NodesMissing as exc:
        print(f"slime-rl: {exc}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    gpus = sum(int(n.get("Resources", {}).get("GPU", 0)) for n in joined)
    print(f"slime-rl: {len(joined)} Ray nodes joined ({gpus} GPUs)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
