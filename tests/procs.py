"""Run several processes of one test scenario (one per rank) and collect their output."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# one thread per rank on the 2-core machines; megatron's import-time warnings drown the logs
QUIET_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def run_processes(cmds: Sequence[Sequence[str]], what: str, timeout: float = 300,
                  envs: Sequence[dict[str, str]] | None = None, tail: int = 6000) -> list[str]:
    """Start every command at once (ranks must meet), wait for all, kill stragglers; returns their
    logs, or raises RuntimeError with the end of each log when any exits non-zero."""
    envs = envs or [{} for _ in cmds]
    procs = [subprocess.Popen(list(cmd), cwd=ROOT, env={**os.environ, **QUIET_ENV, **env}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for cmd, env in zip(cmds, envs, strict=True)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"{what} failed:\n" + "\n---\n".join(log[-tail:] for log in logs))
    return logs
