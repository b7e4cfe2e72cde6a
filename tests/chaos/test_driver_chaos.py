"""Kills at the driver's worst moments, on CPU with real processes (Ray actors, a Megatron rank on gloo,
the built-in engine):

- the only engine is kill -9'd in the middle of the weight broadcast (after some buckets, before the
  last): --use-fault-tolerance restarts it and syncs again; it ends with the trainer's weights, bit
  for bit;
- the trainer rank is kill -9'd in the middle of a checkpoint save: the run stops naming the rank, the
  save and the previous checkpoint, which stays complete and readable.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import threading
import time

import pytest
import ray

from slime_rl.config import build_config
from slime_rl.engines.client import EngineClient
from slime_rl.train import RunFailed, preflight, train
from tests.e2e.test_fault import KEY, argv
from tests.loop_checks import digit_data_fixture
from tests.ray_zygote import worker_pid

digit_data = digit_data_fixture(16, seed=11)
BUCKET = 1024  # --update-weight-buffer-size: the tiny model's 314 KB go in about 300 buckets


def received(pid: int, http_port: int) -> int:
    """Bytes the process has received over its TCP connections other than its HTTP server's (the
    kernel's per-connection tcp_info through `ss`): the gloo broadcast's, there."""
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True,
                         check=True).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if line[:1].strip():  # a connection: "Recv-Q Send-Q local peer users:((...,pid=N,...))"
            mine = f"pid={pid}," in line and not line.split()[2].endswith(f":{http_port}")
        elif mine:
            m = re.search(r"bytes_received:(\d+)", line)
            total += int(m.group(1)) if m else 0
    return total


def sha(array) -> str:
    return hashlib.sha256(array.astype("float32").tobytes()).hexdigest()


@pytest.mark.slow
def test_engine_killed_during_the_weight_broadcast_is_restarted_and_synced_again(
        ray_session, tiny_qwen2, digit_data, tmp_path):
    from slime_rl.orchestration.cluster import Cluster

    args = argv(tiny_qwen2, digit_data, tmp_path / "run", steps=2)
    args[args.index("--update-weight-buffer-size") + 1] = str(BUCKET)
    cfg = build_config(args + ["--use-fault-tolerance", "--rollout-health-check-timeout", "2"])
    cluster = Cluster(*preflight(cfg), api_key=KEY)
    try:
        cluster.start(train_iters=2)
        cluster.generate(0)
        cluster.train(0)
        pid = ray.get(cluster.engines[0].pid.remote())
        engine = worker_pid(pid)  # the process that serves (tests/ray_zygote.py: pid may be its stand-in)
        port = int(cluster.engine_urls[0].rsplit(":", 1)[1])
        # unarmed sync: the engine receives at least the broadcast's bytes (so the count shows the broadcast)
        before = received(engine, port)
        metrics = cluster.sync_weights(version="1")
        total = metrics["weight_sync/bytes"]
        assert received(engine, port) - before >= total > 100 * BUCKET
        print(f"an unarmed sync: {total:.0f} bytes in {metrics['time/sync_end'] - metrics['time/sync_start']:.2f}s")
        # armed: kill -9 once the engine has received 4 buckets of this sync. The engine is looked at
        # while frozen (SIGSTOP), so the kill lands where the count was taken; frozen, it cannot answer
        # the bucket requests, and the trainer sends a bucket only after the one before was answered
        seen: dict = {}
        start = received(engine, port)

        def kill_mid_broadcast():
            end = time.time() + 60
            while time.time() < end:
                os.kill(engine, signal.SIGSTOP)
                got = received(engine, port) - start
                if got >= 4 * BUCKET:
                    os.kill(engine, signal.SIGKILL)
                    seen["read_before_kill"] = got
                    return
                os.kill(engine, signal.SIGCONT)
                time.sleep(0.005)
        killer = threading.Thread(target=kill_mid_broadcast, daemon=True)
        killer.start()
        metrics = cluster.sync_weights(version="2")
        killer.join(timeout=5)
        assert "read_before_kill" in seen, "the engine was never killed"
        assert seen["read_before_kill"] < total / 2  # in the middle of the broadcast, not after it
        assert metrics["fault/weight_sync_retries"] == 1.0
        new_pid = ray.get(cluster.engines[0].pid.remote())
        assert new_pid != pid
        # the restarted engine holds the trainer's weights, every tensor bit for bit, as version 2
        trainer = {name: sha(t) for name, t in cluster.trainers.hf_weights().items()}
        with EngineClient(cluster.engine_urls[0], api_key=KEY) as c:
            info = c._call("GET", "/weights_checksum")
        assert info["weight_version"] == "2"
        assert {name: info["tensors"][name] for name in trainer} == trainer
        # and serves the next rollout
        m = cluster.generate(1)
        assert m["rollout/groups_kept"] == 8
        print(f"killed after {seen['read_before_kill']} of {int(total)} bytes; re-synced")
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_trainer_killed_during_a_save_leaves_the_previous_checkpoint_and_names_it(
        ray_session, tiny_qwen2, digit_data, tmp_path, monkeypatch):
    from slime_rl.orchestration.cluster import Cluster
    from slime_rl.trainer.checkpoint import checkpoint_model_shapes, is_complete, latest_checkpoint

    ckpt = tmp_path / "ckpt"
    real_save = Cluster.save
    seen: dict = {}

    def save_with_a_kill(self, step):
        if step == 1:  # kill -9 the rank once its save of step 1 has begun writing
            pid = ray.get(self.trainers.actors[0].__ray_call__.remote(lambda actor: os.getpid()))
            tmp = ckpt / "iter_0000001.tmp"

            def kill():
                end = time.time() + 60
                while time.time() < end and not tmp.exists():
                    time.sleep(0.0005)
                os.kill(pid, signal.SIGKILL)
                seen["killed_while_tmp"] = tmp.exists() and not (ckpt / "iter_0000001").exists()
            threading.Thread(target=kill, daemon=True).start()
        return real_save(self, step)

    monkeypatch.setattr(Cluster, "save", save_with_a_kill)
    with pytest.raises(RunFailed) as info:
        train(*preflight(build_config(argv(tiny_qwen2, digit_data, tmp_path / "run", steps=3)
                                      + ["--save", str(ckpt), "--save-interval", "1"])))
    message = str(info.value)
    assert seen.get("killed_while_tmp"), seen
    assert message.startswith("run stopped: trainer rank 0 failed during checkpoint save of step 1: ")
    previous = ckpt / "iter_0000000"
    assert message.endswith(f"To resume: rerun with --load {ckpt} (its last complete checkpoint: {previous}, step 0).")
    assert latest_checkpoint(ckpt) == previous and is_complete(previous)
    # the partial folder of the killed save is removed once the run has stopped every rank
    assert not (ckpt / "iter_0000001").exists() and not (ckpt / "iter_0000001.tmp").exists()
    shapes = checkpoint_model_shapes(previous)  # its metadata reads back: a loadable checkpoint
    assert shapes["embedding.word_embeddings.weight"][1] == 64  # hidden 64, the tiny model's
