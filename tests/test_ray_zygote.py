"""tests/ray_zygote.py: a process started through the zygote's client runs as `python script.py` / `python -m
module` would (argv, environment, working directory, descriptors, exit status), from the warm interpreter,
and signals reach it as they would reach its own process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import ray_zygote

PROBE = """
import os, sys
print("argv", sys.argv[1:])
print("cwd", os.getcwd())
print("env", os.environ["ZYGOTE_PROBE"])
print("preloaded", "colorsys" in sys.modules)  # imported by the zygote, never by this script
print("fd", os.read(int(os.environ["PROBE_FD"]), 5).decode())
print("nice", os.getpriority(os.PRIO_PROCESS, 0))
print("own process group", os.getpgid(0) == os.getpid())
print("pid", os.getpid())
sys.stdout.flush()
if sys.argv[1] == "sleep":
    import time
    time.sleep(60)
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """A zygote that preloads a small module (the suite's preloads torch and more: seconds)."""
    proc, python = ray_zygote.start(str(tmp_path_factory.mktemp("zygote")), preload=("colorsys",))
    ray_zygote.wait_ready(proc)
    yield python.split()
    proc.kill()
    proc.wait()


def launch(python: list[str], tmp_path: Path, *args: str) -> tuple[subprocess.Popen, int]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"hello")
    os.close(write_fd)
    env = {**os.environ, "ZYGOTE_PROBE": "here", "PROBE_FD": str(read_fd)}
    proc = subprocess.Popen([*python, str(script), *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            text=True, pass_fds=(read_fd,), preexec_fn=lambda: os.nice(7))
    os.close(read_fd)
    return proc, read_fd


def test_runs_as_its_own_interpreter_would(zygote, tmp_path):
    proc, fd = launch(zygote, tmp_path, "exit", "3")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    lines = out.splitlines()
    # niceness as the client's (launch starts it at nice 7; the zygote runs at this process's)
    assert lines[:-1] == ["argv ['exit', '3']", f"cwd {tmp_path}", "env here", "preloaded True", "fd hello",
                          f"nice {os.getpriority(os.PRIO_PROCESS, 0) + 7}", "own process group True"]
    assert lines[-1] != f"pid {proc.pid}"  # a fork of the zygote did the work, not the client
    assert ray_zygote.worker_pid(os.getpid()) == os.getpid()  # any other process is itself


def test_module_form(zygote, tmp_path):
    (tmp_path / "probe_mod.py").write_text(PROBE)
    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"hello")
    os.close(write_fd)
    env = {**os.environ, "ZYGOTE_PROBE": "mod", "PROBE_FD": str(read_fd)}
    proc = subprocess.run([*zygote, "-m", "probe_mod", "exit", "0"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, pass_fds=(read_fd,), timeout=60)
    os.close(read_fd)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[:3] == ["argv ['exit', '0']", f"cwd {tmp_path}", "env mod"]


def running(proc: subprocess.Popen) -> int:
    """The worker's pid once it has printed its lines (worker_pid, checked against what it printed)."""
    lines = [proc.stdout.readline() for _ in range(8)]
    worker = ray_zygote.worker_pid(proc.pid)
    assert lines[-1].strip() == f"pid {worker}" and worker != proc.pid, lines
    return worker


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # ended, not reaped yet (by init, if orphaned)
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_signals_reach_the_worker(zygote, tmp_path):
    """SIGTERM to the client ends the worker by SIGTERM, and the client's status says so (-15 to Popen)."""
    proc, _ = launch(zygote, tmp_path, "sleep", "0")
    worker = running(proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    assert wait_gone(worker)


def test_a_killed_client_takes_even_a_stopped_worker(zygote, tmp_path):
    """kill -9 of the client (as an engine restart kills a hung engine) ends its worker, stopped or not."""
    proc, _ = launch(zygote, tmp_path, "sleep", "0")
    worker = running(proc)
    os.kill(worker, signal.SIGSTOP)
    proc.kill()
    proc.wait(timeout=30)
    assert wait_gone(worker), f"worker {worker} outlived its client"


def test_worker_killed_reads_as_killed(zygote, tmp_path):
    """kill -9 of the worker: its client ends by SIGKILL too (what Ray and the engine actor see)."""
    proc, _ = launch(zygote, tmp_path, "sleep", "0")
    os.kill(running(proc), signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_client_is_a_bare_interpreter():
    """The client imports nothing beyond the standard library (it runs under -S: no site-packages)."""
    code = "import sys; sys.argv = ['x']; import tests.ray_zygote as z; print(sorted(m for m in sys.modules " \
           "if m.split('.')[0] in ('torch', 'ray', 'slime_rl', 'numpy')))"
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_engine_python_wraps_the_engine_command(monkeypatch):
    """SLIME_RL_ENGINE_PYTHON (how the suite starts engines from the zygote; a user's wrapper) is the command's
    head, split as a shell splits it; unset, the driver's interpreter."""
    from slime_rl.config.builtin_engine import ServerConfig
    from slime_rl.engines.launch import ENGINE_PYTHON_ENV, embedded_command

    cfg = ServerConfig("/m", "127.0.0.1", 30000)
    monkeypatch.delenv(ENGINE_PYTHON_ENV, raising=False)
    plain = embedded_command(cfg)
    assert plain[:3] == [sys.executable, "-m", "slime_rl.engines.embedded"]
    monkeypatch.setenv(ENGINE_PYTHON_ENV, "numactl --cpunodebind=1 '/opt/my python/bin/python'")
    assert embedded_command(cfg) == ["numactl", "--cpunodebind=1", "/opt/my python/bin/python", *plain[1:]]
    assert embedded_command(cfg, python="/usr/bin/python3")[0] == "/usr/bin/python3"  # an explicit one wins


def test_a_killed_zygote_takes_its_workers(tmp_path):
    """kill -9 of the zygote (its test session killed): its workers end too (PR_SET_PDEATHSIG)."""
    proc, python = ray_zygote.start(str(tmp_path), preload=("colorsys",))
    ray_zygote.wait_ready(proc)
    client, _ = launch(python.split(), tmp_path, "sleep", "0")
    worker = running(client)
    proc.kill()
    proc.wait()
    try:
        assert wait_gone(worker), f"worker {worker} outlived its zygote"
    finally:
        client.kill()
        client.wait()
