"""Faults on CPU, nothing faked: Ray actors, Megatron ranks on gloo, two built-in engine processes.

- kill -9 of one engine in the middle of a rollout (--use-fault-tolerance): the step still gets
  every group, every sample id exactly once; the engine comes back (new process, same actor) with
  the trainer's weights (per-tensor sha256, /weights_checksum) and takes requests next step.
- a hung engine (SIGSTOP): its /health times out, its requests go to the other engine.
- both engines back: the rollout's own routing (no router) sends requests to both, each sample once, and
  both hold every weight update (tests/rollout/test_two_engines_cluster.py: the same behind sglang-router).
- a trainer rank that raises mid-run: the run stops with a message naming the rank and the
  checkpoint to resume from; --load resumes from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
import ray

from slime_rl.config import build_config
from slime_rl.engines.client import EngineClient
from slime_rl.train import RunFailed, preflight, train
from tests.loop_checks import digit_data_fixture
from tests.ray_zygote import worker_pid

KEY = "fault-test-secret"
PROMPTS, N = 8, 4




digit_data = digit_data_fixture(64, seed=3)


def argv(model, data, run_dir, steps, tp=1):
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--run-dir", str(run_dir),
            "--tensor-model-parallel-size", str(tp), "--actor-num-gpus-per-node", str(tp),
            "--rollout-batch-size", str(PROMPTS), "--n-samples-per-prompt", str(N),
            "--micro-batch-size", "8", "--rollout-max-response-len", "24", "--num-rollout", str(steps),
            "--rm-type", "digit", "--lr", "0.003", "--update-weight-buffer-size", "20000"]


def wait_running(url: str, timeout: float = 60.0) -> None:
    """Until the engine has a request in flight (it is mid-rollout)."""
    end = time.time() + timeout
    with EngineClient(url, api_key=KEY, timeout=5) as c:
        while time.time() < end:
            if c.get_server_info()["internal_states"][0]["num_running_reqs"] > 0:
                return
            time.sleep(0.005)
    raise AssertionError(f"{url} never had a request running")


def dumped_ids(run_dir, step: int) -> tuple[list[int], list[int]]:
    rows = [json.loads(x) for x in (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
    return sorted(r["index"] for r in rows), sorted(r["group"] for r in rows)


def assert_key_nowhere(key: str, *dirs, text: str = "") -> int:
    """The API key is in no file under `dirs` (metrics, dumps, checkpoints, Ray's logs with every
    engine's output) and not in `text` (captured stdout/stderr). Returns the files searched."""
    assert key not in text
    n = 0
    for root in dirs:
        for path in Path(root).rglob("*"):
            if path.is_file() and not path.is_symlink():
                n += 1
                assert key.encode() not in path.read_bytes(), path
    return n


def ray_logs() -> str:
    return ray._private.worker._global_node.get_logs_dir_path()


def sha(array) -> str:
    return hashlib.sha256(array.astype("float32").tobytes()).hexdigest()


@pytest.mark.slow
def test_killed_and_hung_engines_lose_no_sample_and_come_back_with_the_weights(
        ray_session, tiny_qwen2, digit_data, tmp_path):
    from slime_rl.orchestration.cluster import Cluster

    run = tmp_path / "run"
    cfg = build_config(argv(tiny_qwen2, digit_data, run, steps=3) + [
        "--rollout-num-gpus", "2", "--sglang-server-concurrency", "4", "--use-fault-tolerance",
        "--rollout-health-check-interval", "0.5", "--rollout-health-check-timeout", "5", "--dump-rollouts"])
    cluster = Cluster(*preflight(cfg), api_key=KEY)
    try:
        cluster.start(train_iters=3)
        # ---- step 0: kill -9 engine 1 while it generates
        victim, old_url = 1, cluster.engine_urls[1]
        old_pid = ray.get(cluster.engines[victim].pid.remote())
        assert KEY not in Path(f"/proc/{old_pid}/cmdline").read_text()  # argv is world-readable: not there
        pending = cluster.generate_async(0)
        wait_running(old_url)
        os.kill(old_pid, signal.SIGKILL)
        m0 = cluster.wait(pending)
        ids, groups = dumped_ids(run, 0)
        assert ids == list(range(PROMPTS * N))  # every sample once: none lost, none twice
        assert groups == sorted(g for g in range(PROMPTS) for _ in range(N))
        assert m0["rollout/groups_kept"] == PROMPTS
        assert m0["rollout/engines_dead"] == 1 and m0["rollout/requests_retried"] >= 1
        cluster.train(0)
        # ---- between steps: restarted in its actor, new group, current weights
        assert cluster.heal_engines() == 1
        new_pid = ray.get(cluster.engines[victim].pid.remote())
        assert new_pid != old_pid and cluster.engine_urls[victim] != old_url
        assert KEY not in Path(f"/proc/{new_pid}/cmdline").read_text()
        cluster.sync_weights(version="1")
        trainer = {name: sha(t) for name, t in cluster.trainers.hf_weights().items()}
        sums = []
        for url in cluster.engine_urls:
            with EngineClient(url, api_key=KEY) as c:
                info = c._call("GET", "/weights_checksum")
            with EngineClient(url) as anonymous, pytest.raises(Exception, match="401"):
                anonymous._call("GET", "/weights_checksum")  # a control endpoint: key required
            assert info["weight_version"] == "1"
            assert {name: info["tensors"][name] for name in trainer} == trainer  # bit-exact, every tensor
            sums.append(info["checksum"])
        assert sums[0] == sums[1]
        # ---- step 1: the restarted engine serves again; engine 0 hangs (SIGSTOP) mid-rollout
        hung_pid = ray.get(cluster.engines[0].pid.remote())
        pending = cluster.generate_async(1)
        wait_running(cluster.engine_urls[0])
        os.kill(worker_pid(hung_pid), signal.SIGSTOP)  # the serving process (tests/ray_zygote.py)
        m1 = cluster.wait(pending)
        ids, _ = dumped_ids(run, 1)
        assert ids == list(range(PROMPTS * N, 2 * PROMPTS * N))
        assert m1["rollout/engine1_requests"] > 0  # the restarted engine took requests
        assert m1["rollout/engines_dead"] == 1 and m1["rollout/requests_retried"] >= 1
        cluster.train(1)
        assert cluster.heal_engines() == 1  # the stopped process is killed and replaced
        assert ray.get(cluster.engines[0].pid.remote()) != hung_pid
        cluster.sync_weights(version="2")
        m2 = cluster.generate(2)
        assert m2["rollout/engines_dead"] == 0
        # ---- step 2, both engines healthy (the rollout's own routing, no router): the requests reach both, each
        # sample once; by each engine's own count too (engine 0's process is new since the second update: its
        # count is step 2's); both hold the second update
        assert m2["rollout/engine0_requests"] > 0 and m2["rollout/engine1_requests"] > 0
        assert m2["rollout/engine0_requests"] + m2["rollout/engine1_requests"] == PROMPTS * N
        for k, url in enumerate(cluster.engine_urls):
            with EngineClient(url, api_key=KEY) as c:
                assert c.get_model_info()["weight_version"] == "2"
                finished = c.get_server_info()["internal_states"][0]["requests_finished"]
            assert finished == m2["rollout/engine0_requests"] if k == 0 else finished > 0, (k, finished)
    finally:
        cluster.shutdown()
    assert assert_key_nowhere(KEY, run, ray_logs()) > 0


@pytest.mark.slow
def test_a_crashed_trainer_rank_stops_the_run_naming_it_and_resume_continues(
        ray_session, tiny_qwen2, digit_data, tmp_path, monkeypatch, capfd):
    import secrets

    from slime_rl.orchestration import trainer_group
    from slime_rl.trainer.checkpoint import latest_checkpoint
    from tests.rank_hooks import FAILING_RANK, FAILING_STEP, RankFailingAtStep

    assert (FAILING_RANK, FAILING_STEP) == (1, 1)
    real_actor = trainer_group.RankActor
    monkeypatch.setattr(trainer_group, "RankActor", RankFailingAtStep)  # rank 1 raises in train(1)
    run_key = secrets.token_hex(16)
    monkeypatch.setattr("slime_rl.train.secrets.token_hex", lambda n: run_key)  # to look for it afterwards
    ckpt = tmp_path / "ckpt"
    args = argv(tiny_qwen2, digit_data, tmp_path / "a", steps=3, tp=2) + ["--save", str(ckpt), "--save-interval", "1"]
    with pytest.raises(RunFailed) as info:
        train(*preflight(build_config(args)))
    message = str(info.value)
    assert "trainer rank 1 failed during train step 1" in message and "injected failure" in message
    assert f"--load {ckpt}" in message
    assert latest_checkpoint(ckpt).name == "iter_0000000"  # step 0's checkpoint is intact and complete
    monkeypatch.setattr(trainer_group, "RankActor", real_actor)
    rows = train(*preflight(build_config(
        argv(tiny_qwen2, digit_data, tmp_path / "b", steps=2, tp=2) + ["--load", str(ckpt)])))
    assert [r["step"] for r in rows] == [1]  # auto-resume continues after the last complete step
    out = capfd.readouterr()
    assert assert_key_nowhere(run_key, tmp_path, ray_logs(), text=out.out + out.err) > 0
    # the other rank's result, never fetched once rank 1 failed, is not printed as Ray's "Unhandled error"
    assert "Unhandled error" not in out.out + out.err, (out.out + out.err)[-3000:]


@pytest.mark.slow
def test_reward_failures_are_scored_counted_and_a_fully_broken_step_stops_the_run(
        ray_session, tiny_qwen2, digit_data, tmp_path):
    from tests.rewards.plugins.failing_rewards import BROKEN_FROM

    run = tmp_path / "run"
    args = argv(tiny_qwen2, digit_data, run, steps=2) + [
        "--custom-rm-path", "tests.rewards.plugins.failing_rewards:flaky_then_broken",
        "--reward-failure-value", "-0.5", "--dump-rollouts"]
    assert PROMPTS * N == BROKEN_FROM  # step 0 is flaky, every sample of step 1 raises
    with pytest.raises(RunFailed, match="step 1: the reward function raised on every one of the step's 32") as info:
        train(*preflight(build_config(args)))
    assert "KeyError" in str(info.value)  # the traceback comes with it
    (row,) = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 0 and row["rollout/reward_failures"] == len(range(0, 32, 3))  # 0, 3, ..., 30
    dumped = [json.loads(x) for x in (run / "rollouts" / "step_000000.jsonl").read_text().splitlines()]
    assert all((d["reward"] == -0.5) == (d["index"] % 3 == 0) for d in dumped)
