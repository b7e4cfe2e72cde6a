"""The processes the driver started go when it goes, even on `kill -9`.

A driver that starts its own Ray (no RAY_ADDRESS) is the ancestor of everything of the run: Ray's
GCS and raylet, their agents, the actors' workers and the engine servers under them. On SIGKILL
Ray's GCS and raylet follow the driver, but the dashboard and runtime-env agents (and whatever a
worker was doing) are re-parented to init and stay. `start_reaper` launches a small watcher in its
own session: every second it records the driver's descendants (pid and start time); when the
driver is gone (the pipe it holds closes: any exit, kill -9 included) it sends SIGTERM to every
recorded process still alive with the same start time, then SIGKILL after a grace period. Only
processes that were the driver's descendants are touched: never anything found by name, and a pid
reused by an unrelated process is skipped (its start time differs)."""

from __future__ import annotations

import os
import select
import subprocess
import sys

import psutil

POLL_S = 1.0
GRACE_S = 5.0


def descendants(pid: int) -> dict[int, float]:
    """{pid: create_time} of every live descendant of `pid`."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return {}
    out = {}
    for p in children:
        try:
            out[p.pid] = p.create_time()
        except psutil.Error:
            pass
    return out


def reap(recorded: dict[int, float], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM every recorded process still alive (same start time), SIGKILL the rest after
    `grace_s`; returns the pids signalled."""
    procs = []
    for pid, created in recorded.items():
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 1e-3:
                procs.append(p)
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return [p.pid for p in procs]


def watch(driver: int, pipe_fd: int, poll_s: float = POLL_S) -> None:
    """Record the driver's descendants until `pipe_fd` reads EOF (the driver is gone), then reap."""
    recorded: dict[int, float] = {}
    while True:
        recorded.update(descendants(driver))
        ready, _, _ = select.select([pipe_fd], [], [], poll_s)
        if ready and not os.read(pipe_fd, 4096):
            break
    recorded.update(descendants(driver))  # a clean exit: the driver may still be tearing down
    reap({pid: t for pid, t in recorded.items() if pid != os.getpid()})


def start_reaper() -> subprocess.Popen:
    """Start the watcher for this process; it lives in its own session (a Ctrl-C or a kill of the
    driver's process group does not take it first) and holds the read end of a pipe whose write end
    only this process holds."""
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "slime_rl.orchestration.reaper", str(os.getpid()), str(read_fd)],
                            pass_fds=(read_fd,), start_new_session=True, stdin=subprocess.DEVNULL)
    os.close(read_fd)
    os.set_inheritable(write_fd, False)  # children must not keep the driver "alive"
    start_reaper.write_fd = write_fd  # type: ignore[attr-defined]  # kept open for the life of the driver
    return proc


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]))
