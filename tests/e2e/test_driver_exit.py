"""A driver that is killed (kill -9: no handler runs) takes what it started with it: Ray's GCS, raylet
and agents, the actors' workers, the engine server. `slime-rl train` runs as a real process here,
starting its own Ray; only the processes that were its descendants are looked at."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests import ray_zygote
from tests.e2e.test_fault import argv
from tests.loop_checks import digit_data_fixture
from tests.procs import ROOT

digit_data = digit_data_fixture(16, seed=7)


def tree(pid: int) -> dict[int, tuple[float, str]]:
    """{pid: (start time, command line)} of the live descendants of `pid`, following each client of the
    suite's warm interpreter (tests/ray_zygote.py) to the forked process that does its work, and on to that
    process's own children (an engine actor's server): a killed client takes its worker with it."""
    out: dict[int, tuple[float, str]] = {}
    todo = psutil.Process(pid).children(recursive=True)
    while todo:
        p = todo.pop()
        try:
            if p.pid in out:
                continue
            out[p.pid] = (p.create_time(), " ".join(p.cmdline()))
            worker = ray_zygote.worker_pid(p.pid)
            if worker != p.pid:
                todo.append(psutil.Process(worker))
                todo += psutil.Process(worker).children(recursive=True)
        except (psutil.Error, OSError):
            pass
    return out


def still_alive(recorded: dict[int, tuple[float, str]]) -> dict[int, str]:
    alive = {}
    for pid, (created, cmd) in recorded.items():
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) < 1e-3 and p.status() != psutil.STATUS_ZOMBIE:
                alive[pid] = cmd
        except psutil.Error:
            pass
    return alive


@pytest.mark.slow
@pytest.mark.parametrize("how, save_on_signal", [(signal.SIGKILL, False), (signal.SIGTERM, False),
                                                 (signal.SIGTERM, True)], ids=["kill-9", "sigterm", "sigterm-save"])
def test_a_killed_driver_leaves_no_process_behind(how, save_on_signal, ray_session, tiny_qwen2, digit_data,
                                                  tmp_path):
    """kill -9: no handler runs, the reaper takes everything down. SIGTERM (a scheduler's preemption) in
    the middle of a checkpoint save (every step saves): the run unwinds, says in one sentence that it
    stopped on SIGTERM and from which checkpoint to resume, exits 143 (Ray's crash handler answered it with
    134 and a stack dump before) and leaves no partial save; resuming from the checkpoint before the one
    named repeats the step that followed it exactly. With --exit-signal-handler the step under way finishes
    and is saved first, and the sentence names it."""
    from slime_rl.trainer.checkpoint_layout import TMP_SUFFIX, is_complete

    run = tmp_path / "run"
    ckpt = tmp_path / "ckpt"
    if save_on_signal:
        extra = ["--exit-signal-handler", "--save", str(ckpt)]
    elif how == signal.SIGTERM:
        extra = ["--save", str(ckpt), "--save-interval", "1", "--deterministic-rollout"]
    else:
        extra = []
    # its own Ray; its workers and engine start from the suite's warm interpreter where one runs (Ray's job
    # config variable and SLIME_RL_ENGINE_PYTHON, as a user's launcher could set them): their clients are in the
    # driver's tree, and `tree` follows each to its worker
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **ray_zygote.job_env()}
    log = (tmp_path / "driver.log").open("w")
    driver = subprocess.Popen([sys.executable, "-m", "slime_rl.train",
                               *argv(tiny_qwen2, digit_data, run, steps=1000), *extra],
                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    recorded: dict[int, tuple[float, str]] = {}
    try:
        # what a run starts under its driver: Ray's processes, actors, an engine server, the reaper
        parts = ("gcs_server", "raylet", "ray::RankActor", "slime_rl.engines", "slime_rl.orchestration.reaper")
        deadline = time.time() + 240
        while time.time() < deadline:  # until every part of the run is up
            assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            recorded |= tree(driver.pid)
            commands = " ".join(cmd for _, cmd in recorded.values())
            if all(part in commands for part in parts):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"not every part started in time: {sorted(c for _, c in recorded.values())}")
        time.sleep(2.0)
        if save_on_signal:  # the loop under way: after the first step's line (a step takes < 1 s, so
            # the signal lands in any phase of a later step)
            deadline = time.time() + 120
            while "step    1/1000" not in (tmp_path / "driver.log").read_text() and time.time() < deadline:
                assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
                time.sleep(0.2)
        elif how == signal.SIGTERM:  # while the save of step 2 or a later one is being written
            deadline, k = time.time() + 120, 2
            while not (ckpt / f"iter_{k:07d}{TMP_SUFFIX}").exists() and time.time() < deadline:
                assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
                if is_complete(ckpt / f"iter_{k:07d}"):  # written between two looks: the next one
                    k += 1
                time.sleep(0.002)
        recorded |= tree(driver.pid)
        os.kill(driver.pid, how)
        code = driver.wait(timeout=120)
        if save_on_signal:
            out = (tmp_path / "driver.log").read_text()
            assert code == 143, out[-3000:]
            assert "slime-rl train: SIGTERM received: the step under way finishes, a checkpoint is saved" in out
            found = re.search(r"slime-rl train: run stopped: SIGTERM received; step (\d+) finished and is saved "
                              r"\(--exit-signal-handler\); stopping the engines and trainers\. To resume: rerun with "
                              rf"--load {re.escape(str(ckpt))} \(its last complete checkpoint: (\S+), step (\d+)\)",
                              out)
            assert found, out[-3000:]
            step = int(found.group(1))
            assert step >= 1 and int(found.group(3)) == step  # a step after the first line, the one saved
            assert found.group(2) == str(ckpt / f"iter_{step:07d}") and is_complete(found.group(2))
            assert "Traceback" not in out, out[-3000:]
        elif how == signal.SIGTERM:
            out = (tmp_path / "driver.log").read_text()
            assert code == 143, out[-3000:]
            found = re.search(r"slime-rl train: run stopped: SIGTERM received \(during checkpoint save of step "
                              r"(\d+)\); stopping the engines and trainers\. To resume: rerun with --load "
                              rf"{re.escape(str(ckpt))} \(its last complete checkpoint: (\S+), step (\d+)\)", out)
            assert found, out[-3000:]
            stopped, named = int(found.group(1)), int(found.group(3))
            # the save under way is not complete (or had just finished when the signal came)
            assert stopped >= k and named in (stopped - 1, stopped), (stopped, named)
            assert found.group(2) == str(ckpt / f"iter_{named:07d}") and is_complete(found.group(2))
            assert not list(ckpt.glob(f"*{TMP_SUFFIX}")), sorted(p.name for p in ckpt.iterdir())  # no partial save
            assert "*** SIGTERM received" not in out and "Traceback" not in out, out[-3000:]
            resume_exactly(tiny_qwen2, digit_data, tmp_path, ckpt, step=stopped - 2)  # its next step is logged
        deadline = time.time() + 30
        while still_alive(recorded) and time.time() < deadline:
            time.sleep(0.5)
        left = still_alive(recorded)
        assert not left, f"left behind after kill -9 of the driver: {left}"
    finally:
        if driver.poll() is None:
            driver.kill()
        for pid in still_alive(recorded):  # only what this test's driver started
            os.kill(pid, signal.SIGKILL)


def resume_exactly(model, data, tmp_path, ckpt, step: int) -> None:
    """--load of the checkpoint of `step` (of the stopped run, whose metrics logged the step after it):
    the step after it repeats bit for bit (rollouts seeded by sample index; weights, Adam, the LR schedule,
    RNG and data position from the checkpoint)."""
    import json

    from slime_rl.config import build_config
    from slime_rl.train import preflight, train

    logged = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    args = argv(model, data, tmp_path / "resumed", steps=step + 2) + [
        "--deterministic-rollout", "--load", str(ckpt / f"iter_{step:07d}")]
    (row,) = train(*preflight(build_config(args)))
    assert row["step"] == step + 1
    for key in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/grad_norm"):
        assert row[key] == logged[step + 1][key], (key, row[key], logged[step + 1][key])
