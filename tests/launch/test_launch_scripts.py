"""The launch scripts' commands: --launch-dry-run prints them (and runs none), `--dry-run` reaches
`slime-rl train`; a worker whose head never answers gives up naming it. The whole loop through
slurm_example.sbatch and ray_multi_node.sh on a 2-node Ray cluster: test_slurm_cluster.py."""

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
# what a caller's shell may hold that would change the commands
CLEAN = {k: v for k, v in os.environ.items()
         if k not in ("RAY_ADDRESS", "MASTER_ADDR", "NODE_RANK", "NNODES", "NODE_IP", "RAY_PORT", "RAY_START_ARGS",
                      "LAUNCH_DRY_RUN", "NUM_GPUS", "SLURM_JOB_NODELIST", "SLURM_SUBMIT_DIR")}


def launch(script, *args, flag="--launch-dry-run", **env) -> subprocess.CompletedProcess:
    argv = ["bash", str(ROOT / "launch" / script), *([flag] if flag else []), *args]
    return subprocess.run(argv, capture_output=True, text=True, env={**CLEAN, "PYTHON": "python3", **env}, cwd=ROOT,
                          timeout=120)


def dry(script, *args, **env):
    out = launch(script, *args, **env)
    assert out.returncode == 0, out.stderr
    return [shlex.split(line[2:]) for line in out.stdout.splitlines() if line.startswith("+ ")]


def value(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def test_single_node_starts_a_head_then_runs_the_driver_with_the_train_flags():
    cmds = dry("ray_single_node.sh", "--config", "configs/quickstart_cpu.yaml", "--lr", "1e-6", "--dry-run",
               NUM_GPUS="4")
    start, wait, driver = cmds  # no job server, nothing to release on one node
    assert start[:3] == ["ray", "start", "--head"] and value(start, "--num-gpus") == "4"
    assert start[-2:] == ["--block", "&"]
    assert wait[1:3] == ["-m", "slime_rl.orchestration.nodes"] and value(wait, "--nodes") == "1"
    assert driver[:2] == ["env", "RAY_ADDRESS=127.0.0.1:6379"]
    # the trainer's own --dry-run goes through
    assert driver[3:] == ["-m", "slime_rl.cli", "train", "--config", "configs/quickstart_cpu.yaml", "--lr", "1e-6",
                          "--dry-run"]
    # the old print-only switch is now the environment variable or --launch-dry-run
    assert dry("ray_single_node.sh", "--config", "c.yaml", flag=None, LAUNCH_DRY_RUN="1", NUM_GPUS="4") == [
        *cmds[:2],
        ["env", "RAY_ADDRESS=127.0.0.1:6379", "python3", "-m", "slime_rl.cli", "train", "--config", "c.yaml"]]


def test_multi_node_head_waits_for_the_workers_runs_the_driver_then_releases_them():
    head = dry("ray_multi_node.sh", "--num-rollout", "3", "--dry-run", MASTER_ADDR="10.0.0.1", NODE_RANK="0",
               NNODES="2", NODE_WAIT_TIMEOUT="30", NODE_LEAVE_TIMEOUT="9", RAY_PORT="6400",
               RAY_START_ARGS="--temp-dir /scratch/ray --num-cpus 16")
    start, wait, driver, release = head
    assert start[:3] == ["ray", "start", "--head"] and value(start, "--node-ip-address") == "10.0.0.1"
    assert value(start, "--port") == "6400" and start[-6:] == ["--temp-dir", "/scratch/ray", "--num-cpus", "16",
                                                                "--block", "&"]
    assert wait[1:3] == ["-m", "slime_rl.orchestration.nodes"]
    assert value(wait, "--address") == "10.0.0.1:6400" and value(wait, "--nodes") == "2"
    assert value(wait, "--timeout") == "30"
    assert driver[:2] == ["env", "RAY_ADDRESS=10.0.0.1:6400"] and driver[3:6] == ["-m", "slime_rl.cli", "train"]
    assert driver[-3:] == ["--num-rollout", "3", "--dry-run"]
    assert "--release" in release and value(release, "--timeout") == "9"
    assert not any("job" in cmd for cmd in head)


def test_multi_node_worker_waits_for_the_head_then_joins_until_released():
    reach, start, until = dry("ray_multi_node.sh", MASTER_ADDR="10.0.0.1", NODE_RANK="1", NODE_IP="10.0.0.2",
                              HEAD_WAIT_TIMEOUT="45", RAY_START_ARGS="--num-cpus 16")
    assert "--reachable" in reach and value(reach, "--address") == "10.0.0.1:6379" and value(reach, "--timeout") == "45"
    assert start[:4] == ["ray", "start", "--address", "10.0.0.1:6379"]
    assert value(start, "--node-ip-address") == "10.0.0.2"
    assert start[-4:] == ["--num-cpus", "16", "--block", "&"]
    assert "--until-released" in until and value(until, "--address") == "10.0.0.1:6379"


def test_a_ray_address_in_the_environment_is_named_and_not_used():
    out = launch("ray_multi_node.sh", MASTER_ADDR="10.0.0.1", NODE_RANK="0", NNODES="2", RAY_ADDRESS="10.9.9.9:1")
    assert out.returncode == 0 and "RAY_ADDRESS=10.9.9.9:1 in the environment is not used" in out.stderr
    assert "RAY_ADDRESS=10.0.0.1:6379" in out.stdout and "10.9.9.9" not in out.stdout


def test_multi_node_head_needs_the_node_count():
    out = launch("ray_multi_node.sh", MASTER_ADDR="10.0.0.1", NODE_RANK="0")
    assert out.returncode != 0 and "NNODES" in out.stderr and "ray start" not in out.stdout


def test_a_worker_whose_head_never_answers_gives_up_naming_it():
    port = free_port()  # closed again: nothing answers there
    t0 = time.monotonic()
    out = launch("ray_multi_node.sh", flag=None, MASTER_ADDR="127.0.0.1", NODE_RANK="1", RAY_PORT=str(port),
                 HEAD_WAIT_TIMEOUT="1", PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    assert out.returncode == 1, out.stderr
    assert f"the Ray head at 127.0.0.1:{port} did not answer within 1 s" in out.stderr
    assert "HEAD_WAIT_TIMEOUT" in out.stderr and "ray start" not in out.stdout  # it never tried to join
    assert time.monotonic() - t0 < 30


def test_slurm_job_starts_the_head_step_first_with_the_train_flags(tmp_path):
    (tmp_path / "scontrol").write_text('#!/usr/bin/env bash\ntr , "\\n" <<< "$3"\n')
    (tmp_path / "scontrol").chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu1,gpu2,gpu3",
           "SLURM_SUBMIT_DIR": str(ROOT)}
    out = launch("slurm_example.sbatch", "--config", "c.yaml", "--dry-run", MASTER_ADDR="10.0.0.7", **env)
    assert out.returncode == 0, out.stderr
    assert "+ head gpu1 at 10.0.0.7: MASTER_ADDR given in the environment" in out.stdout
    steps = [shlex.split(x[2:]) for x in out.stdout.splitlines() if x.startswith("+ env ")]
    assert [value(s, "-w") for s in steps] == ["gpu1", "gpu2", "gpu3"]  # the head's step first
    assert steps[0][1:4] == ["MASTER_ADDR=10.0.0.7", "NNODES=3", "NODE_RANK=0"]
    assert steps[0][-4:] == ["--config", "c.yaml", "--dry-run", "&"]
    assert steps[2][1:4] == ["MASTER_ADDR=10.0.0.7", "NNODES=3", "NODE_RANK=2"]
    assert steps[2][-2:] == ["launch/ray_multi_node.sh", "&"]
    # without MASTER_ADDR: the address the node helper finds for the first node (tests/orchestration/test_wait_nodes.py)
    (tmp_path / "python").write_text('#!/usr/bin/env bash\n[ "$3 $4" = "--ipv4-of gpu1" ] && echo 10.1.2.3\n')
    (tmp_path / "python").chmod(0o755)
    found = launch("slurm_example.sbatch", PYTHON=str(tmp_path / "python"), **env)
    assert found.returncode == 0, found.stderr
    assert "+ head gpu1 at 10.1.2.3\n" in found.stdout and "MASTER_ADDR=10.1.2.3 NNODES=3 NODE_RANK=1" in found.stdout


def test_convert_wrapper_runs_torchrun_with_the_tool():
    (cmd,) = dry("convert_torchrun.sh", "hf_to_megatron", "--hf-dir", "/m", "--out", "/o", NPROC="2")
    assert cmd[:5] == ["torchrun", "--standalone", "--nproc-per-node", "2", cmd[4]]
    assert cmd[4].endswith("tools/convert_hf_to_megatron.py") and cmd[5:] == ["--hf-dir", "/m", "--out", "/o"]


def test_no_launch_script_kills_by_name():
    for f in (ROOT / "launch").iterdir():
        text = f.read_text()
        assert "pkill" not in text and "killall" not in text and "ray stop" not in text.replace("`ray stop`", ""), f
