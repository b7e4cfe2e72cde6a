"""What a converter process needs before it imports Megatron: its place in a torchrun launch, the
(TP, PP) layout it runs at, and relaunching itself under torchrun with one process per shard."""

from __future__ import annotations

import os
import socket
import sys
from typing import Any


def launcher_env() -> tuple[int, int, str, int]:
    """(rank, world, master_addr, master_port) from torchrun's variables, or a world of one on a
    free local port (a tool run alone)."""
    if "WORLD_SIZE" in os.environ:
        return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ.get("MASTER_ADDR", "127.0.0.1"),
                int(os.environ["MASTER_PORT"]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return 0, 1, "127.0.0.1", s.getsockname()[1]


def converter_layout(world: int, tp: int | None, pp: int, ep: int = 1) -> tuple[int, int]:
    """(tp, pp) a converter runs at: one process per model shard. Dense: TP x PP = world (DP is
    pointless there); `tp` defaults to world / pp. With expert parallelism (EP > 1, the experts
    split over ETP = TP ranks as Megatron's default) a stage needs lcm(TP, EP x TP) = EP x TP
    processes, the dense part replicated over EP; `tp` defaults to world / (pp x ep). SystemExit
    names the flags otherwise."""
    if pp < 1 or world % pp != 0:
        raise SystemExit(f"--pipeline-model-parallel-size {pp} does not divide the {world} processes")
    tp = tp or world // (pp * ep)
    if tp * pp * ep != world:
        raise SystemExit(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} x "
                         f"--expert-model-parallel-size {ep} with {world} processes: run exactly TP x PP x EP "
                         "processes (one per shard)")
    return tp, pp


def check_expert_parallel(arch: Any, ep: int) -> None:
    """SystemExit unless `ep` divides the experts of the arch (convert.ModelArch) when it is > 1."""
    if ep > 1 and (not arch.num_experts or arch.num_experts % ep != 0):
        raise SystemExit(f"--expert-model-parallel-size {ep}: {arch.model_type} has {arch.num_experts or 'no'} "
                         "experts per layer, not a multiple of it")


def relaunch_per_shard(script: str, argv: list[str], tp: int | None, pp: int, ep: int = 1) -> None:
    """A converter started alone (`python tools/convert_*.py ... --tp 2`) needs TP x PP processes: start
    them with torchrun on this node instead of failing. Returns when it was started by a launcher
    (WORLD_SIZE set) or needs one process; otherwise replaces this process with torchrun's."""
    if "WORLD_SIZE" in os.environ or (tp or 1) * pp * ep <= 1:
        return
    n = (tp or 1) * pp * ep
    print(f"[slime_rl] {n} shards (TP {tp or 1} x PP {pp} x EP {ep}): running {n} processes under torchrun",
          flush=True)
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={n}", script, *argv])
