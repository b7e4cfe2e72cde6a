"""tests/procs.run_processes, the multi-rank scenario runner: a rank that dies stops the others."""

from __future__ import annotations

import sys
import time

import pytest

from tests.procs import run_processes


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
