"""Run several processes of one test scenario (one per rank) and collect their output.

A rank that runs Python code (`python -m module ...` or `python script.py ...`) starts as a fork of a
warm interpreter on CPU machines: a multiprocessing forkserver that has imported torch and megatron-core
(through slime_rl's trainer, as a rank imports them) once per pytest process. A rank then starts in
milliseconds instead of paying the 3-5 s of imports (a few hundred rank processes per suite run). The rank
runs the same module with the same argv, environment, working directory and log file; only the
interpreter's start is shared. Set SLIME_RL_TEST_FORKSERVER=0 to start every rank with a fresh
interpreter (always so on GPU machines, where a forked CUDA runtime would be a different test).
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# one thread per rank on the 2-core machines; megatron's import-time warnings drown the logs
QUIET_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
# what a rank imports first: the forkserver imports it once, every rank forked from it has it
PRELOAD = ["torch", "slime_rl.trainer.rank", "slime_rl.trainer.convert"]
_CONTEXT: multiprocessing.context.BaseContext | None = None


def _forkserver() -> multiprocessing.context.BaseContext | None:
    """The warm-interpreter context, started on first use; None where ranks start fresh (a GPU machine,
    SLIME_RL_TEST_FORKSERVER=0)."""
    global _CONTEXT
    if _CONTEXT is None:
        import torch

        if os.environ.get("SLIME_RL_TEST_FORKSERVER", "1") == "0" or torch.cuda.is_available():
            return None
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CONTEXT = ctx
    return _CONTEXT


def _run_rank(argv: list[str], env: dict[str, str], log_path: str, err_path: str | None = None,
              exit_handlers: bool = False) -> None:
    """In the forked rank: the command's environment, working directory and log file (stderr to
    `err_path` when given), then its module or script as __main__ (what `python -m` / `python script.py`
    would run). `exit_handlers`: run the atexit handlers at the end, as an interpreter's exit does (a
    forked process ends without them: a Ray session the command started would be left running)."""
    for target, path in ((1, log_path), (2, err_path or log_path)):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    if env.get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    import torch

    if env.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        if argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv[1:])
            sys.path.insert(0, str(Path(argv[1]).resolve().parent))  # as `python script.py` puts its folder first
            runpy.run_path(argv[1], run_name="__main__")
    finally:
        if exit_handlers:
            import atexit

            atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


def _forkable(cmd: Sequence[str]) -> bool:
    """A Python command of a module or a script file (not -c code, not another program)."""
    return (len(cmd) >= 2 and cmd[0] == sys.executable
            and ((cmd[1] == "-m" and len(cmd) >= 3) or (cmd[1].endswith(".py") and not cmd[1].startswith("-"))))


class _Forked:
    """A forked rank, with the part of Popen's interface run_processes uses."""

    def __init__(self, ctx: multiprocessing.context.BaseContext, cmd: Sequence[str], env: dict[str, str],
                 log_path: str, err_path: str | None = None, exit_handlers: bool = False) -> None:
        self._proc = ctx.Process(target=_run_rank, args=(list(cmd), env, log_path, err_path, exit_handlers),
                                 daemon=False)
        self._proc.start()

    def poll(self) -> int | None:
        return self._proc.exitcode

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()

    def wait(self) -> int | None:
        self._proc.join()
        return self._proc.exitcode


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
        ctx = _forkserver() if all(_forkable(c) for c in cmds) else None
        procs = [_Forked(ctx, cmd, {**os.environ, **QUIET_ENV, **env}, f.name) if ctx is not None
                 else subprocess.Popen(list(cmd), cwd=ROOT, env={**os.environ, **QUIET_ENV, **env}, stdout=f,
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


def run_python(cmd: Sequence[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    """One Python command (`sys.executable script.py ...` or `-m module`), as subprocess.run with
    capture_output and text would run it, from the warm interpreter where ranks start from it; stdout
    and stderr apart. Raises subprocess.TimeoutExpired after `timeout` seconds (the process killed)."""
    ctx = _forkserver() if _forkable(cmd) else None
    if ctx is None:
        return subprocess.run(list(cmd), capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="run_python_") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        out.touch()
        err.touch()
        proc = _Forked(ctx, cmd, dict(env), str(out), str(err), exit_handlers=True)
        proc._proc.join(timeout)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            raise subprocess.TimeoutExpired(list(cmd), timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(list(cmd), proc.returncode, out.read_text(), err.read_text())
