"""Ray's worker processes of the test session start as forks of a warm interpreter (CPU machines only).

A Ray actor of the loop (a trainer rank, the RolloutManager, an engine actor) spends 3-6 CPU-seconds
importing torch, Megatron and transformers before it does anything, and the suite starts a few hundred of
them on a 2-core machine. `ray_session` (tests/conftest.py) starts one zygote per pytest process: a server
that imports those modules once and forks a worker for every request. Ray starts each worker through the
session's `py_executable` (Ray's runtime_env field for the interpreter that runs `default_worker.py`): this
file's client, a bare interpreter (`python -S`, no imports beyond the standard library), sends its argv,
environment, working directory and standard streams (SCM_RIGHTS) to the zygote, waits for the forked worker
and exits with its status; signals it gets are passed on. The worker is the same `default_worker.py` with
the same argv, environment and streams; it registers with the raylet under its own pid (as a worker under
`uv run` does), so Ray's kills and the tests' `kill -9` of a rank reach it directly. Only the interpreter's
start is shared, as in tests/procs.py for the ranks the trainer tests start. The built-in engine's processes
start the same way (SLIME_RL_ENGINE_PYTHON, the interpreter command engines are launched with, set to the
client for the session): `python -m slime_rl.engines.embedded ...` forked from the zygote, its listening
socket passed on under the same descriptor number. A test that must signal the engine itself (SIGSTOP)
finds it with worker_pid().

SLIME_RL_TEST_RAY_ZYGOTE=0 starts every worker with a fresh interpreter (always so on GPU machines, where a
forked CUDA runtime would be a different test).
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Sequence

# what the loop's actors import first: torch, transformers, Megatron (through the trainer) and the rooms the
# RolloutManager uses. Not ray: importing it builds Ray's C++ config from the zygote's environment, and a
# worker needs its own (RAY_JOB_ID, set by the raylet per worker); a worker imports ray itself (~0.6 s).
PRELOAD = ("torch", "transformers", "transformers.models.auto.tokenization_auto", "slime_rl.trainer.worker",
           "slime_rl.rollout.custom", "slime_rl.rollout.eval", "slime_rl.rollout.dynamic", "slime_rl.rewards",
           "slime_rl.engines.client", "slime_rl.engines.launch", "slime_rl.weight_sync.broadcast",
           "slime_rl.observability.debug_data", "slime_rl.data", "slime_rl.engines.embedded.server",
           "slime_rl.engines.embedded.cli")
_HEADER = struct.Struct("!I")
CURRENT: str | None = None  # the client command of the suite's running zygote (set by ray_session)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the client went away")
        data += chunk
    return data


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:  # the listing's own descriptor, closed by now
        return False
    return True


def client(sock_path: str, argv: list[str]) -> None:
    """Ray's "interpreter": hand the worker's start to the zygote, then stand in for it until it exits."""
    import json
    import time

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + 120
    while True:  # the zygote may still be importing: it listens once its preload is done
        try:
            conn.connect(sock_path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    # every descriptor this process has (its streams, and what its starter passed on: the engine's listening
    # socket) goes to the worker under the same number
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) != conn.fileno())
    fds = [fd for fd in fds if _is_open(fd)]
    umask = os.umask(0)
    os.umask(umask)
    # what a child inherits besides: its niceness (Ray's workers run at nice 15, what they start too: the engine
    # at nice 0 would win every core from the ranks and the RolloutManager), CPU affinity, umask
    payload = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds,
                          "nice": os.getpriority(os.PRIO_PROCESS, 0), "cpus": sorted(os.sched_getaffinity(0)),
                          "umask": umask}).encode()
    socket.send_fds(conn, [_HEADER.pack(len(payload))], fds)
    conn.sendall(payload)
    reader = conn.makefile("rb")
    pid = int(reader.readline())

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    line = reader.readline()
    code = int(line) if line else 1
    if code < 0:  # ended by a signal: end the same way, as the worker's own process would have
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot have a handler
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _run_worker(conn: socket.socket, request: dict, fds: list[int], zygote: int) -> None:
    """In the forked child: the client's streams, environment, working directory, niceness, CPU affinity and
    umask, then the worker script as __main__ (what `python default_worker.py ...` runs)."""
    import fcntl
    import runpy

    # out of the way first: a received descriptor may hold a number another one goes to
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1000) for fd in fds]
    for fd in fds:
        os.close(fd)
    conn.close()  # the zygote keeps its end: it kills this worker when the client goes away
    for target, fd in zip(request["fds"], moved, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    # its own process group, as Ray's workers have (the zygote's is the test session's): Ray's raylet ends a
    # worker's whole group when it stops, and with the zygote's group that took pytest and its Ray with it
    os.setpgid(0, 0)
    # and it does not outlive the zygote (killed with its test session, kill -9 included): the kernel ends it
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != zygote:  # the zygote went before prctl took effect
        os._exit(1)
    os.setpriority(os.PRIO_PROCESS, 0, request["nice"])
    os.sched_setaffinity(0, request["cpus"])
    os.umask(request["umask"])
    if os.environ.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    argv = request["argv"]
    code = 0
    try:
        if argv[0] == "-m":  # python -m module ...
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # python script.py ...
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:  # a message: printed, status 1, as the interpreter does
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001  (printed as the interpreter would, then the worker's exit)
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _recv_or_gone(conn: socket.socket) -> bytes:
    try:
        return conn.recv(1)
    except OSError:
        return b""


def serve(sock_path: str, preload: Sequence[str] = PRELOAD) -> None:
    """Import `preload` once, then fork a worker per request; each worker's exit status goes back to its
    client. Ends when the pytest process that started it is gone."""
    import importlib
    import json
    import select
    import warnings

    with warnings.catch_warnings():  # megatron's import-time warnings; the interpreter's filters stay as they were
        warnings.simplefilter("ignore")
        for name in preload:
            importlib.import_module(name)
    if "ray" in sys.modules:
        raise SystemExit(f"the Ray worker zygote imported ray with {preload}: its workers would take its config")
    import threading

    if threading.active_count() > 1:  # a fork copies only the forking thread: locks others hold stay held
        raise SystemExit(f"the Ray worker zygote has threads after its imports: {threading.enumerate()}")
    import gc

    # what the preload made is never collected: out of the collector's sight, a worker's collections scan only
    # its own objects (not Megatron's and the engine's modules too: seconds of the loop's rollout otherwise)
    gc.collect()
    gc.freeze()
    parent, zygote = os.getppid(), os.getpid()
    pids = sock_path + ".pids"
    os.makedirs(pids, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(64)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([listener, *children.values()], [], [], 0.05)
        for pid, conn in list(children.items()):
            if conn in ready and not _recv_or_gone(conn):  # the client is gone (killed): so goes its worker,
                try:  # even a stopped one (SIGSTOP), which could not notice it itself
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if listener in ready:
            conn, _ = listener.accept()
            try:
                header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 250)
                request = json.loads(_recv_exact(conn, _HEADER.unpack(header)[0]))
            except (OSError, ValueError, struct.error):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _run_worker(conn, request, fds, zygote)
            for fd in fds:
                os.close(fd)
            children[pid] = conn
            client_pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            with open(os.path.join(pids, str(client_pid)), "w") as f:  # for worker_pid(), before the client goes on
                f.write(str(pid))
            conn.sendall(f"{pid}\n".encode())
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def enabled() -> bool:
    """False where workers start fresh: SLIME_RL_TEST_RAY_ZYGOTE=0, or a GPU machine."""
    if os.environ.get("SLIME_RL_TEST_RAY_ZYGOTE", "1") == "0":
        return False
    import torch

    return not torch.cuda.is_available()


def start(tmp_dir: str, preload: Sequence[str] = PRELOAD) -> tuple[subprocess.Popen, str]:
    """Start the zygote (it imports `preload`: a few seconds, while the caller goes on); returns its process
    and the `py_executable` for Ray's runtime_env (the client's command)."""
    sock_path = os.path.join(tmp_dir, "ray_zygote.sock")
    here = os.path.abspath(__file__)
    root = os.path.dirname(os.path.dirname(here))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, here, "serve", sock_path, *preload], env=env, stdout=subprocess.PIPE,
                            stderr=None, stdin=subprocess.DEVNULL, text=True)
    return proc, f"{sys.executable} -S {here} connect {sock_path}"


def wait_ready(proc: subprocess.Popen) -> None:
    """Block until the zygote listens (its imports done); RuntimeError if it ended instead."""
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the Ray worker zygote did not start (exit code {proc.wait()})")


if __name__ == "__main__":
    if sys.argv[1] == "connect":
        client(sys.argv[2], sys.argv[3:])
    else:
        serve(sys.argv[2], sys.argv[3:])


def worker_pid(pid: int) -> int:
    """The process that does the work of `pid`: the forked worker where `pid` is this file's client (an
    engine or actor started through the zygote), else `pid` itself. For tests that signal a process as such
    (SIGSTOP to hang an engine: the client would stop, not the engine)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().split(b"\0")
    except OSError:
        return pid
    if len(cmd) > 4 and cmd[2].endswith(b"ray_zygote.py") and cmd[3] == b"connect":
        with open(os.fsdecode(cmd[4]) + ".pids/" + str(pid)) as f:
            return int(f.read())
    return pid


def job_env() -> dict[str, str]:
    """The environment for a driver in a subprocess that joins the session's Ray (RAY_ADDRESS): Ray's job
    config variable naming the zygote's client as its workers' interpreter, as the session's own job has it.
    Empty when no zygote runs."""
    if CURRENT is None:
        return {}
    import json

    return {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": {"py_executable": CURRENT}})}
