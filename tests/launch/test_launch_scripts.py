"""Each launch script with --dry-run prints the commands it would run (and runs none)."""

import os
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def dry(script, *args, **env):
    out = subprocess.run(["bash", str(ROOT / "launch" / script), "--dry-run", *args], capture_output=True, text=True,
                         env={**os.environ, "PATH": os.environ["PATH"], **env}, check=True, cwd=ROOT).stdout
    return [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("+ ")]


def test_single_node_starts_head_then_submits_train_with_flags():
    cmds = dry("ray_single_node.sh", "--config", "configs/quickstart_cpu.yaml", "--lr", "1e-6", NUM_GPUS="4")
    assert cmds[0][:3] == ["ray", "start", "--head"] and cmds[0][cmds[0].index("--num-gpus") + 1] == "4"
    submit = cmds[1]
    assert submit[:3] == ["ray", "job", "submit"]
    tail = submit[submit.index("--") + 1:]
    assert tail[1:] == ["-m", "slime_rl.cli", "train", "--config", "configs/quickstart_cpu.yaml", "--lr", "1e-6"]
    assert '"NCCL_NVLS_ENABLE": "0"' in submit[submit.index("--runtime-env-json") + 1]


def test_multi_node_head_waits_for_the_workers_then_submits():
    head = dry("ray_multi_node.sh", "--num-rollout", "3", MASTER_ADDR="10.0.0.1", NODE_RANK="0", NNODES="2",
               NODE_WAIT_TIMEOUT="30")
    assert head[0][:3] == ["ray", "start", "--head"] and "10.0.0.1" in head[0]
    wait = head[1]
    assert wait[1:3] == ["-m", "slime_rl.orchestration.nodes"]
    assert wait[wait.index("--address") + 1] == "10.0.0.1:6379" and wait[wait.index("--nodes") + 1] == "2"
    assert wait[wait.index("--timeout") + 1] == "30"
    assert head[2][:3] == ["ray", "job", "submit"] and head[2][-2:] == ["--num-rollout", "3"]
    worker = dry("ray_multi_node.sh", MASTER_ADDR="10.0.0.1", NODE_RANK="1")
    assert len(worker) == 1 and worker[0][:4] == ["ray", "start", "--address", "10.0.0.1:6379"]


def test_multi_node_head_needs_the_node_count():
    env = {k: v for k, v in os.environ.items() if k != "NNODES"}
    out = subprocess.run(["bash", str(ROOT / "launch" / "ray_multi_node.sh"), "--dry-run"], capture_output=True,
                         text=True, env={**env, "MASTER_ADDR": "10.0.0.1", "NODE_RANK": "0"}, cwd=ROOT)
    assert out.returncode != 0 and "NNODES" in out.stderr and "ray start" not in out.stdout


def test_convert_wrapper_runs_torchrun_with_the_tool():
    (cmd,) = dry("convert_torchrun.sh", "hf_to_megatron", "--hf-dir", "/m", "--out", "/o", NPROC="2")
    assert cmd[:5] == ["torchrun", "--standalone", "--nproc-per-node", "2", cmd[4]]
    assert cmd[4].endswith("tools/convert_hf_to_megatron.py") and cmd[5:] == ["--hf-dir", "/m", "--out", "/o"]


def test_no_launch_script_kills_by_name():
    for f in (ROOT / "launch").iterdir():
        text = f.read_text()
        assert "pkill" not in text and "killall" not in text, f
