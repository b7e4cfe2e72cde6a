"""The driver's one error format, for failures that come back through Ray as they do in a run: raised
in a Ray task or actor (RayTaskError wrapping them), gathered like the trainer ranks' results."""

from __future__ import annotations

import json

import pytest
import ray

from slime_rl.orchestration.failures import EngineFailure, describe, is_out_of_memory, resume_hint, root_cause


@pytest.fixture(scope="module")
def ray_one_cpu(ray_session):
    """The shared test Ray session (tests/conftest.py)."""


def raised_in_ray(fn) -> BaseException:
    """What the driver gets when `fn` raises in a Ray task."""
    with pytest.raises(ray.exceptions.RayError) as info:
        ray.get(ray.remote(fn).remote())
    return info.value


def allocate_too_much():
    import torch

    torch.empty(2**62, dtype=torch.uint8)  # 4 EiB: torch's CPU allocator refuses it (ENOMEM)


def every_engine_dead():
    from slime_rl.rollout.health import NoLiveEngineError

    raise NoLiveEngineError("every rollout engine is dead: {0: 'engine http://h:1/generate unreachable'}")


def engine_refused():
    raise EngineFailure("http://h:1", "/generate", None, "RemoteProtocolError: Server disconnected")


def test_an_out_of_memory_rank_is_named_with_what_to_lower(ray_one_cpu):
    from slime_rl.orchestration.trainer_group import TrainerRankError, gather_ranks

    with pytest.raises(TrainerRankError) as info:
        gather_ranks([ray.remote(lambda: {}).remote(), ray.remote(allocate_too_much).remote()], "train step 3")
    assert is_out_of_memory(info.value.__cause__)
    text, known = describe(info.value, phase="train", step=3, save=None, fault_tolerance=False)
    assert known
    assert text.startswith("run stopped: trainer rank 1 failed during train step 3: ")
    assert "Cannot allocate memory" in text  # torch's own words, the last line of the rank's error
    assert "The rank ran out of memory: lower --micro-batch-size" in text
    assert text.endswith("No checkpoint to resume from (--save is not set): rerun to start over.")


def test_no_live_engine_and_a_dead_engine_through_ray(ray_one_cpu, tmp_path):
    exc = raised_in_ray(every_engine_dead)
    assert type(root_cause(exc)).__name__ == "NoLiveEngineError"
    text, known = describe(exc, phase="rollout", step=2, save=str(tmp_path / "none"), fault_tolerance=False)
    assert known and text == (
        "run stopped: no live rollout engine: every rollout engine is dead: {0: 'engine http://h:1/generate "
        "unreachable'} (during rollout of step 2). --use-fault-tolerance restarts dead engines and generates the "
        f"step again. No checkpoint to resume from (none complete under --save {tmp_path / 'none'} yet): rerun "
        "to start over.")
    text, _ = describe(exc, phase="rollout", step=2, save=None, fault_tolerance=True)
    assert "The engines died again after each restart" in text
    # an engine error survives the trip through Ray with its fields (EngineError itself would not)
    exc = raised_in_ray(engine_refused)
    assert root_cause(exc).url == "http://h:1"
    text, _ = describe(exc, phase="rollout", step=0, save=None, fault_tolerance=False)
    assert text.startswith("run stopped: rollout engine at http://h:1 died (RemoteProtocolError: Server "
                           "disconnected) (during rollout of step 0). --use-fault-tolerance restarts")


def test_an_unexpected_error_is_marked_for_its_traceback(ray_one_cpu):
    exc = raised_in_ray(lambda: {}["missing"])
    text, known = describe(exc, phase="eval", step=4, save=None, fault_tolerance=False)
    assert not known and text.startswith("run stopped: KeyError: 'missing' (during eval of step 4).")


def replay_file_missing():
    from slime_rl.data.debug_rollouts import read_debug_rollout

    read_debug_rollout("/no/such/rollout_3.pt", 3, 4, 2)


def test_a_missing_replay_file_is_a_known_failure_naming_it(ray_one_cpu):
    exc = raised_in_ray(replay_file_missing)
    text, known = describe(exc, phase="rollout", step=3, save=None, fault_tolerance=False)
    assert known and text.startswith("run stopped: --load-debug-rollout-data: no file /no/such/rollout_3.pt for "
                                     "step 3 (the template formatted with rollout_id=3) (during rollout of step 3).")


def test_resume_hint_without_a_save_folder():
    assert resume_hint(None) == "No checkpoint to resume from (--save is not set): rerun to start over."


def unreadable_shard():
    raise RuntimeError("CheckpointingException: __1_0.distcp: unexpected end of file")


@ray.remote(num_cpus=0)
class Waiter:
    """A rank that waits in a collective for a peer that will not come."""

    def wait(self, seconds: float) -> None:
        import time

        time.sleep(seconds)

    def shutdown(self) -> None:
        import time

        time.sleep(3600)


def test_a_load_failing_on_one_rank_stops_at_once_naming_the_other_checkpoints(ray_one_cpu, tmp_path):
    """One rank fails to read its shard while the other waits at the load's barrier: the failure comes
    back at once (the waiting rank is not awaited), and the sentence names the other checkpoints with
    their --load, not --save's hint."""
    import time

    from slime_rl.orchestration.trainer_group import LOAD_WHAT, TrainerRankError, gather_ranks

    root = tmp_path / "ckpt"
    for step in (0, 1, 2):  # three complete checkpoints, as a save leaves them
        folder = root / f"iter_{step:07d}"
        folder.mkdir(parents=True)
        (folder / "metadata.json").write_text("{}")
        (folder / "slime_rl_checkpoint.json").write_text(json.dumps({"step": step, "contents": ["model"], "extra": {}}))
    waiter = Waiter.remote()
    start = time.monotonic()
    with pytest.raises(TrainerRankError) as info:
        gather_ranks([waiter.wait.remote(600), ray.remote(num_cpus=0)(unreadable_shard).remote()],
                     f"{LOAD_WHAT} {root / 'iter_0000002'}")
    assert time.monotonic() - start < 30
    ray.kill(waiter)
    text, known = describe(info.value, phase="resume from --load", step=None, save=None, fault_tolerance=False)
    assert known
    assert text == (f"run stopped: trainer rank 1 failed during checkpoint load of {root / 'iter_0000002'}: "
                    "RuntimeError: CheckpointingException: __1_0.distcp: unexpected end of file. iter_0000002 could "
                    f"not be loaded; intact checkpoints: iter_0000000 (--load {root / 'iter_0000000'}); "
                    f"iter_0000001 (--load {root / 'iter_0000001'}).")


def test_ranks_that_do_not_stop_are_killed_after_the_timeout(ray_one_cpu, capsys):
    """RankGroup.shutdown: a rank stuck in a collective does not hold the run's end."""
    import time

    from slime_rl.orchestration.trainer_group import POLICY, RankGroup

    group = object.__new__(RankGroup)  # its actors only: no Megatron ranks needed to stop them
    group.role, group.actors = POLICY, [Waiter.remote(), Waiter.remote()]
    start = time.monotonic()
    group.shutdown(timeout_s=2)
    assert 2 <= time.monotonic() - start < 20
    assert "2 trainer rank(s) did not stop within 2 s: killed" in capsys.readouterr().out
    for actor in group.actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.wait.remote(0), timeout=20)
