"""Wait until a Ray cluster has its nodes: `launch/ray_multi_node.sh` runs this on the head before it
submits the job, so a run never starts (and fails its placement) on a half-joined cluster.

    python -m slime_rl.orchestration.nodes --address HEAD_IP:6379 --nodes 2 [--timeout 600]

Exit status 0 once `--nodes` nodes are alive; 1 with a message naming who joined and what to run
when the timeout passes first; 2 when the head cannot be reached.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence


class NodesMissing(RuntimeError):
    """Fewer nodes joined than expected before the timeout; the message says which and what to do."""


def alive_nodes() -> list[dict]:
    """The alive nodes of the cluster this process is connected to (ray.nodes() entries)."""
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def wait_for_nodes(expected: int, timeout_s: float, nodes: Callable[[], list[dict]] = alive_nodes,
                   poll_s: float = 2.0, address: str = "the head") -> list[dict]:
    """Poll `nodes()` until `expected` nodes are alive; returns them, or raises NodesMissing after
    `timeout_s` seconds (the message lists the nodes that joined and their GPUs)."""
    if expected < 1:
        raise ValueError(f"--nodes must be >= 1, got {expected}")
    deadline = time.monotonic() + timeout_s
    seen: list[dict] = []
    while True:
        seen = nodes()
        if len(seen) >= expected:
            return seen
        if time.monotonic() >= deadline:
            break
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
    joined = ", ".join(f"{n.get('NodeManagerAddress', '?')} ({int(n.get('Resources', {}).get('GPU', 0))} GPUs)"
                       for n in seen) or "none"
    raise NodesMissing(
        f"{len(seen)} of {expected} Ray nodes joined {address} within {timeout_s:g} s (joined: {joined}); start "
        f"the missing ones with MASTER_ADDR=<head ip> NODE_RANK=<1..{expected - 1}> bash launch/ray_multi_node.sh, "
        "check that they reach the head's port, or raise NODE_WAIT_TIMEOUT")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slime_rl.orchestration.nodes", description=__doc__.splitlines()[0])
    p.add_argument("--address", required=True, help="the head's Ray address, HOST:PORT")
    p.add_argument("--nodes", type=int, required=True, help="nodes the cluster must have, the head included")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (default 600)")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between checks")
    a = p.parse_args(argv)
    import ray

    try:
        ray.init(address=a.address, logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        print(f"slime-rl: cannot reach the Ray head at {a.address}: {exc}", file=sys.stderr)
        return 2
    try:
        joined = wait_for_nodes(a.nodes, a.timeout, poll_s=a.poll, address=f"the head at {a.address}")
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
