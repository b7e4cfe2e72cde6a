"""tests/procs.run_processes, the multi-rank scenario runner: a rank that dies stops the others; tests/procs.run_python,
one command as subprocess.run would run it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.procs import ROOT, _forkserver, run_processes, run_python


def test_a_failing_rank_stops_the_waiting_ones_and_its_log_is_kept():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        run_processes([[sys.executable, "-c", "import sys; print('bind: EADDRINUSE'); sys.exit(3)"],
                       [sys.executable, "-c", "import time; time.sleep(60)"]], "two ranks", timeout=50)
    assert time.monotonic() - t0 < 20  # not the sleeper's 60 s, nor the 50 s timeout
    assert "rank 0 exited with 3" in str(err.value) and "EADDRINUSE" in str(err.value)


def test_logs_larger_than_a_pipe_and_timeouts():
    # 1 MB of output (a pipe holds 64 KB): collected whole, in order
    logs = run_processes([[sys.executable, "-c", "print('x' * 1_000_000); print('end')"]] * 2, "big", timeout=60)
    assert all(log.endswith("end\n") and len(log) > 1_000_000 for log in logs)
    with pytest.raises(RuntimeError, match="timed out after 1 s"):
        run_processes([[sys.executable, "-c", "import time; time.sleep(30)"]], "sleeper", timeout=1)


def test_a_python_rank_runs_as_its_own_command_would_from_a_warm_interpreter(tmp_path):
    """`python script.py ARGS` and `python -m module ARGS` ranks (forked from the warm forkserver on CPU): the
    script's argv, the command's environment, the repo as working directory, its output in its log, its
    exit code; torch already imported (what the forkserver saves)."""
    script = tmp_path / "rank_probe.py"
    script.write_text("import os, sys\n"
                      "print('argv', sys.argv[1:], 'cwd', os.getcwd() == os.environ['WANT_CWD'])\n"
                      "print('env', os.environ['PROBE'], 'torch preloaded', 'torch' in sys.modules)\n"
                      "print('main', __name__)\n"
                      "sys.exit(int(sys.argv[1]))\n")
    cmd = [sys.executable, str(script)]
    env = {"WANT_CWD": str(ROOT)}
    logs = run_processes([cmd + ["0", "x y"], cmd + ["0", "z"]], "probe", timeout=120,
                         envs=[{**env, "PROBE": "a"}, {**env, "PROBE": "b"}])
    assert "argv ['0', 'x y'] cwd True" in logs[0] and "argv ['0', 'z'] cwd True" in logs[1]
    assert "env a" in logs[0] and "env b" in logs[1] and all("main __main__" in log for log in logs)
    assert all(f"torch preloaded {_forkserver() is not None}" in log for log in logs)
    with pytest.raises(RuntimeError, match="exit codes 3|rank 0 exited with 3"):
        run_processes([cmd + ["3"]], "probe", timeout=120, envs=[{**env, "PROBE": "c"}])
    # a module (`python -m`): the same, through runpy as `-m` runs it
    logs = run_processes([[sys.executable, "-m", "tests.rank_probe_module", "7"]], "module", timeout=120)
    assert logs[0].strip().splitlines()[-1] == "module __main__ ['7']"


def test_one_python_command_as_subprocess_run_would_run_it(tmp_path):
    """run_python: stdout and stderr apart, the exit code, and the atexit handlers run at the end (a forked
    process skips them; a Ray session a bench script started would outlive it); a timeout kills it."""
    marker = tmp_path / "atexit_ran"
    script = tmp_path / "probe.py"
    script.write_text("import atexit, os, pathlib, sys\n"
                      "atexit.register(lambda: pathlib.Path(os.environ['MARKER']).write_text('yes'))\n"
                      "print('out', sys.argv[1:]); print('err', file=sys.stderr)\n"
                      "sys.exit(int(sys.argv[1]))\n")
    env = {**os.environ, "MARKER": str(marker)}
    done = run_python([sys.executable, str(script), "0"], env, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, "out ['0']\n", "err\n")
    assert marker.read_text() == "yes"
    assert run_python([sys.executable, str(script), "5"], env, timeout=120).returncode == 5
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(30)\n")
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_python([sys.executable, str(sleeper)], env, timeout=1)
    assert time.monotonic() - t0 < 20
