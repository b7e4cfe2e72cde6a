"""launch/slurm_example.sbatch, unchanged, on this one machine: `scontrol` and `srun` are small scripts on
PATH (srun runs its command here, as the named node would), so the job runs launch/ray_multi_node.sh once
per node and makes a real 2-node Ray cluster, the head on 127.0.0.2 and the other node on 127.0.0.3, each
with its own temp dir and ports (nothing shared with the suite's own Ray). The driver trains 2 steps of the
CPU quickstart (configs/quickstart_cpu.yaml: a Megatron TP=2 trainer and one built-in engine; 2 CPUs per
node, so its 3 bundles cannot all be on one node). Every process the job started is gone when it ends."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from slime_rl.orchestration.reaper import descendants
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"

SCONTROL = """#!/usr/bin/env bash
# scontrol show hostnames a,b -> one name a line
[ "$1 $2" = "show hostnames" ] || { echo "scontrol shim: only 'show hostnames'" >&2; exit 2; }
tr , '\\n' <<< "$3"
"""
SRUN = """#!/usr/bin/env bash
# srun [--opt=v ...] -w NODE CMD...: CMD on this machine with NODE's environment (NODE_IP, RAY_START_ARGS)
node=
while [ $# -gt 0 ]; do case "$1" in -w) node=$2; shift 2;; -*) shift;; *) break;; esac; done
source "$SHIM_NODES/$node.env"
exec "$@"
"""


def _shims(tmp: Path, temp_root: Path) -> tuple[Path, Path]:
    bin_dir, nodes = tmp / "bin", tmp / "nodes"
    bin_dir.mkdir()
    nodes.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    # the head's dashboard and Ray-client ports and each node's agent port: free ones, not Ray's defaults
    (nodes / "node-a.env").write_text(
        f'export RAY_START_ARGS="--temp-dir {temp_root}/a --num-cpus 2 --dashboard-port {free_port()} '
        f'--ray-client-server-port {free_port()} --dashboard-agent-listen-port {free_port()}"\n')
    (nodes / "node-b.env").write_text(
        f'export NODE_IP={WORKER_IP} RAY_START_ARGS="--temp-dir {temp_root}/b --num-cpus 2 '
        f'--dashboard-agent-listen-port {free_port()}"\n')
    return bin_dir, nodes


def _alive(recorded: dict[int, float], temp_root: Path) -> dict[int, str]:
    """Recorded descendants still alive (same start time), and any process naming this test's Ray temp dir."""
    out = {}
    for p in psutil.process_iter(["pid", "cmdline", "create_time", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.info["cmdline"] or [])
            mine = p.info["pid"] in recorded and abs(recorded[p.info["pid"]] - p.info["create_time"]) < 1e-3
            if mine or str(temp_root) in cmd:
                out[p.info["pid"]] = cmd[:160]
        except psutil.Error:
            pass
    return out


@pytest.mark.slow
def test_slurm_job_trains_two_steps_on_a_two_node_ray_cluster(tiny_qwen2, tmp_path):
    from slime_rl.data.digits import make_rows, write_jsonl

    data = write_jsonl(make_rows(64, seed=0), tmp_path / "digits.jsonl")
    run_dir = tmp_path / "run"
    # short: Ray's unix sockets live under it (a socket path has at most 107 bytes)
    temp_root = Path(tempfile.mkdtemp(prefix="slr-", dir="/tmp"))
    bin_dir, nodes = _shims(tmp_path, temp_root)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "SLURM_", "MASTER_", "NODE_"))}
    env |= {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:{env['PATH']}", "PYTHON": sys.executable,
            "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "SHIM_NODES": str(nodes),
            "SLURM_JOB_NODELIST": "node-a,node-b", "SLURM_SUBMIT_DIR": str(ROOT), "MASTER_ADDR": HEAD_IP,
            "RAY_PORT": str(free_port()), "NUM_GPUS": "0", "NODE_WAIT_TIMEOUT": "180", "HEAD_WAIT_TIMEOUT": "180"}
    argv = ["--config", "configs/quickstart_cpu.yaml", "--hf-checkpoint", str(tiny_qwen2), "--prompt-data", str(data),
            "--run-dir", str(run_dir), "--num-rollout", "2", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
            "--global-batch-size", "32", "--micro-batch-size", "32"]
    log_path = tmp_path / "job.log"
    recorded: dict[int, float] = {}
    job = None
    try:
        with log_path.open("w") as log:
            job = subprocess.Popen(["bash", str(ROOT / "launch" / "slurm_example.sbatch"), *argv], cwd=tmp_path,
                                   env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 420
        while job.poll() is None and time.time() < deadline:
            recorded |= descendants(job.pid)
            time.sleep(0.5)
        assert job.poll() is not None, "the job did not end within 420 s:\n" + log_path.read_text()[-6000:]
        out = log_path.read_text()
        assert job.returncode == 0, out[-6000:]

        # the head first, given as MASTER_ADDR; the other node joined it only once it answered
        assert f"+ head node-a at {HEAD_IP}: MASTER_ADDR given in the environment" in out
        lines = out.splitlines()
        head_start = next(i for i, x in enumerate(lines) if x.startswith("+ ray start --head"))
        worker_start = next(i for i, x in enumerate(lines) if x.startswith(f"+ ray start --address {HEAD_IP}:"))
        assert head_start < worker_start and f"slime-rl: the Ray head at {HEAD_IP}:" in out
        assert "slime-rl: 2 Ray nodes joined (0 GPUs)" in out
        assert f"+ env RAY_ADDRESS={HEAD_IP}:" in out and "ray job submit" not in out

        # the trainer's ranks and the engine on the two nodes (Ray prefixes the lines of an actor that is not on
        # the driver's node with its ip): each step's weight sync went from one node to the other, and the
        # engine's log-probs of the second step are the trainer's, so it got the first step's weights
        engine_ip = re.search(r"\[engine 0\] embedded engine serving .* at http://([0-9.]+):", out).group(1)
        rank_ips = {ip or HEAD_IP for ip in re.findall(r"\(RankActor pid=[0-9]+(?:, ip=([0-9.]+))?\)", out)}
        assert len(rank_ips) == 1 and {engine_ip} | rank_ips == {HEAD_IP, WORKER_IP}, (engine_ip, rank_ips)
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1]
        assert rows[0]["train/grad_norm"] > 0 and all(math.isfinite(r["train/loss"]) for r in rows), rows
        assert all(r["train/rollout_logprob_abs_diff"] < 1e-4 for r in rows), rows

        # the end in order: the head said the run was over, the other node stopped its Ray, then the head its own
        released = out.index(f"slime-rl: the run on the head at {HEAD_IP}:")
        assert released < out.index("slime-rl: the run is over; the other nodes have left") < out.rindex("+ kill -TERM")

        # when the job has ended, so has every process it started
        end = time.time() + 30
        while _alive(recorded, temp_root) and time.time() < end:
            time.sleep(0.5)
        assert not _alive(recorded, temp_root), _alive(recorded, temp_root)
    finally:
        if job is not None and job.poll() is None:
            job.send_signal(signal.SIGTERM)  # the job's trap stops its steps, each its node's Ray
            try:
                job.wait(60)
            except subprocess.TimeoutExpired:
                pass
        for pid in _alive(recorded, temp_root):  # only what this test's job started
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        shutil.rmtree(temp_root, ignore_errors=True)
