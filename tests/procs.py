"""Run several processes of one test scenario (one per rank) and collect their output."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# one thread per rank on the 2-core machines; megatron's import-time warnings drown the logs
QUIET_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def run_processes(cmds: Sequence[Sequence[str]], what: str, timeout: float = 300,
                  envs: Sequence[dict[str, str]] | None = None, tail: int = 6000) -> list[str]:
    """Start every command at once (ranks must meet), wait for all; returns their logs, or raises
    RuntimeError with the end of each log when any exits non-zero or `timeout` passes.

    A rank that fails stops the others at once: they cannot meet without it, and waited on they
    would hang until the timeout (seen: rank 0 died binding a port another process had taken, rank
    1 waited 300 s for its store, and the TimeoutExpired hid the EADDRINUSE that run_scenario
    retries on). Logs go to files, not pipes, so a rank writing more than a pipe holds never blocks."""
    envs = envs or [{} for _ in cmds]
    with tempfile.TemporaryDirectory(prefix="ranks_") as tmp:
        files = [open(Path(tmp) / f"rank{i}.log", "w+") for i in range(len(cmds))]  # noqa: SIM115
        procs = [subprocess.Popen(list(cmd), cwd=ROOT, env={**os.environ, **QUIET_ENV, **env}, stdout=f,
                                  stderr=subprocess.STDOUT, text=True)
                 for cmd, env, f in zip(cmds, envs, files, strict=True)]
        deadline = time.monotonic() + timeout
        why = None
        try:
            while any(p.poll() is None for p in procs):
                failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
                if failed:
                    why = f"rank {failed[0]} exited with {procs[failed[0]].returncode}; the others were stopped"
                    break
                if time.monotonic() > deadline:
                    why = f"timed out after {timeout:.0f} s"
                    break
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        logs = []
        for f in files:
            f.seek(0)
            logs.append(f.read())
            f.close()
    if why is None and any(p.returncode != 0 for p in procs):
        why = "exit codes " + ", ".join(str(p.returncode) for p in procs)
    if why is not None:
        raise RuntimeError(f"{what} failed ({why}):\n" + "\n---\n".join(log[-tail:] for log in logs))
    return logs
