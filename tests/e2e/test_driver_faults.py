"""The driver's failures and recoveries on CPU, nothing faked: Ray actors, a Megatron rank on gloo, the
built-in engine (one, the default), the run started by `train()` as `slime-rl train` does.

- --use-fault-tolerance with the only engine: kill -9 it mid-rollout; the run waits for the restart
  (new process, current weights), generates the step again and finishes; every sample once.
- without it: the same kill stops the run with one sentence naming the engine, the phase and step,
  the flag that would have saved it, and the checkpoint to resume from.
- a filter that keeps nothing: the rollout stops after three passes over the data, saying so.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import ray

from slime_rl.config import build_config
from slime_rl.train import RunFailed, preflight, train
from tests.e2e.test_fault import KEY, PROMPTS, N, argv, dumped_ids, wait_running
from tests.loop_checks import digit_data_fixture

digit_data = digit_data_fixture(16, seed=5)


def kill_engine_mid_rollout(monkeypatch, at_step: int) -> dict:
    """Patch Cluster.generate_async: when rollout `at_step` starts, a thread waits until engine 0 has a
    request running and kill -9s it (once). Returns what happened ({"pid", "url"})."""
    from slime_rl.orchestration.cluster import Cluster

    real = Cluster.generate_async
    seen: dict = {}

    def generate_async(self, step):
        ref = real(self, step)
        if step == at_step and not seen:
            seen["pid"], seen["url"] = ray.get(self.engines[0].pid.remote()), self.engine_urls[0]

            def kill():
                wait_running(seen["url"])
                os.kill(seen["pid"], signal.SIGKILL)
                seen["killed"] = True
            seen["thread"] = threading.Thread(target=kill, daemon=True)
            seen["thread"].start()
        return ref

    monkeypatch.setattr(Cluster, "generate_async", generate_async)
    monkeypatch.setattr("slime_rl.train.secrets.token_hex", lambda n: KEY)  # wait_running asks with it
    return seen


@pytest.mark.slow
def test_single_engine_fault_tolerance_waits_for_the_restart_and_loses_no_sample(
        ray_session, tiny_qwen2, digit_data, tmp_path, monkeypatch):
    run = tmp_path / "run"
    seen = kill_engine_mid_rollout(monkeypatch, at_step=1)
    rows = train(*preflight(build_config(argv(tiny_qwen2, digit_data, run, steps=3) + [
        "--use-fault-tolerance", "--rollout-health-check-interval", "0.5", "--dump-rollouts"])))
    assert seen.get("killed"), "the engine was never killed mid-rollout"
    assert [r["step"] for r in rows] == [0, 1, 2]  # the run finished its steps
    per_step = PROMPTS * N
    for step in range(3):  # every sample id exactly once, the same numbering as a run without the kill
        ids, groups = dumped_ids(run, step)
        assert ids == list(range(step * per_step, (step + 1) * per_step)), step
        assert len(groups) == per_step
    assert rows[1]["fault/rollout_restarts"] == 1.0 and "fault/rollout_restarts" not in rows[2]
    # step 1 was generated again by the restarted engine after the re-sync: the trainer's weights, so the
    # gap is as small as step 0's (same weights on both sides; an engine left on the checkpoint's
    # weights would be one update behind)
    gaps = [r["train/rollout_logprob_abs_diff"] for r in rows]
    assert max(gaps) <= 1e-3, gaps
    print("gaps after a single-engine restart:", gaps)


@pytest.mark.slow
def test_engine_death_without_fault_tolerance_is_one_sentence_with_the_checkpoint(
        ray_session, tiny_qwen2, digit_data, tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    seen = kill_engine_mid_rollout(monkeypatch, at_step=1)
    with pytest.raises(RunFailed) as info:
        train(*preflight(build_config(argv(tiny_qwen2, digit_data, tmp_path / "run", steps=3) + [
            "--save", str(ckpt), "--save-interval", "1"])))
    message = str(info.value)
    assert seen.get("killed")
    assert message.startswith(f"run stopped: rollout engine at {seen['url']} died (")
    assert "(during rollout of step 1)." in message
    assert "--use-fault-tolerance restarts a dead engine" in message
    assert message.endswith(f"To resume: rerun with --load {ckpt} (its last complete checkpoint: "
                            f"{ckpt / 'iter_0000000'}, step 0).")
    assert "Traceback" not in message and "\n" not in message


@pytest.mark.slow
def test_a_filter_that_keeps_nothing_stops_after_three_passes_over_the_data(
        ray_session, tiny_qwen2, digit_data, tmp_path):
    # --rm-type format on the digit task: the tiny model never writes <think>...</think>, every sample
    # scores 0, so DAPO's filter (rewards must differ within a group) drops every group
    args = argv(tiny_qwen2, digit_data, tmp_path / "run", steps=1)
    args[args.index("digit")] = "format"
    args += ["--dynamic-sampling-filter-path", "slime_rl.rollout.filters.check_reward_nonzero_std",
             "--rollout-max-response-len", "4"]
    with pytest.raises(RunFailed) as info:
        train(*preflight(build_config(args)))
    message = str(info.value)
    # 16 prompts drawn PROMPTS (8) at a time: the draw that would pass 3 * 16 stops it, after 48
    assert message.startswith("run stopped: the rollout of step 0 drew 48 prompts (3 passes over the 16 prompts")
    assert "kept fewer than --rollout-batch-size 8 groups: the data is exhausted for this filter" in message
    assert "(during rollout of step 0)." in message
    assert message.endswith("No checkpoint to resume from (--save is not set): rerun to start over.")
