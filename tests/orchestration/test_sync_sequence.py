"""The order of engine calls around one weight sync (#17 rows 1, 4, 7, 8, 9, 10), with fakes for the
engines, the trainer worker and torch.distributed; no Ray, no model.

Expected orders are SGLang 0.5.23's contract (docs/sglang_contract.md): pause, begin_weight_update,
the stages one after another, end_weight_update, continue; colocated: release all three memory-saver
tags after the rollout, resume "weights" before the sync and "kv_cache"/"cuda_graph" after it; a sync
after a release sends the frozen tensors too (SGLang drops released weights)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slime_rl.config import build_config
from slime_rl.orchestration import cluster as cluster_mod
from slime_rl.orchestration import trainer_group as tg
from slime_rl.orchestration.engines import engine_command
from slime_rl.orchestration.placement import EngineSlot
from slime_rl.weight_sync.broadcast import WeightBroadcaster, in_stage_order, with_last
from slime_rl.weight_sync.colocated import ColocatedUpdater

BASE = ["--hf-checkpoint", "m", "--prompt-data", "d.jsonl", "--rollout-batch-size", "4", "--num-rollout", "2",
        "--rm-type", "digit", "--actor-num-gpus-per-node", "2", "--micro-batch-size", "1"]


def test_with_last_marks_only_the_last_bucket():
    assert list(with_last("abc")) == [("a", False), ("b", False), ("c", True)]
    assert list(with_last([])) == []


def test_in_stage_order_runs_stage_after_stage_and_still_meets_the_barriers_on_failure():
    log = []
    for rank in (0, 1):
        in_stage_order(rank, 2, lambda: log.append("barrier"), lambda r=rank: log.append(f"send{r}"))
    # each rank: its send only on its own turn, 2 barriers either way
    assert log == ["send0", "barrier", "barrier", "barrier", "send1", "barrier"]
    met = []

    def boom():
        raise RuntimeError("engine refused")

    with pytest.raises(RuntimeError, match="refused"):
        in_stage_order(0, 3, lambda: met.append(1), boom)
    assert len(met) == 3  # the other stages' ranks are not left waiting


class FakeUpdater:
    def __init__(self, log: list, kind: type) -> None:
        self.log, self.__class__ = log, type("Fake" + kind.__name__, (FakeUpdater, kind), {})

    def pause_engines(self):
        self.log.append("pause")

    def begin_update(self):
        self.log.append("begin")

    def end_update(self, quiet=False):
        self.log.append("end")

    def continue_engines(self):
        self.log.append("continue")

    def sync(self, named, version, own_session=True, stages=None):
        self.log.append(("sync", named, own_session))
        return {"weight_sync/bytes": 1.0, "weight_sync/seconds": 1.0}


def _actor(monkeypatch, log, kind, pp_rank=0, pp_size=1, rank=0):
    monkeypatch.setattr("torch.distributed.barrier", lambda *a, **k: log.append("barrier"))
    actor = object.__new__(tg.RankActor.__ray_actor_class__)
    actor.rank, actor._synced_once, actor.adapters = rank, False, None
    actor.cfg = build_config(BASE, check_paths=False)
    actor.worker = SimpleNamespace(pp_rank=pp_rank, pp_size=pp_size, lora=[],
                                   iter_hf_sources=lambda skip_frozen: f"skip={skip_frozen}")
    actor.broadcaster = FakeUpdater(log, kind)
    return actor


@pytest.mark.parametrize("rank", [0, 1])
def test_an_adapter_sync_sends_the_base_once_then_the_adapters_alone(monkeypatch, rank):
    """--lora-sync adapter: the base (adapters off) by the first sync and after a release that dropped the
    engines' weights, inside the usual pause/session; the adapters by every sync, gathered by every rank
    (collective) and sent by global rank 0 alone, with no pause."""
    log: list = []
    actor = _actor(monkeypatch, log, ColocatedUpdater, rank=rank)
    actor.cfg = build_config(BASE + ["--lora-rank", "4", "--lora-sync", "adapter"], check_paths=False)
    actor.worker.lora = ["an adapter"]
    actor.worker.set_adapters_enabled = lambda on: log.append(("adapters on", on))
    actor.worker.peft_adapter_state = lambda: log.append("gather") or (({"t": 1}, {"r": 4}) if rank == 0 else None)
    if rank == 0:
        actor.adapters = SimpleNamespace(send=lambda tensors, config, version: log.append(("send", version)) or {
            "weight_sync/bytes": 2.0, "weight_sync/seconds": 0.5, "weight_sync/adapter_bytes": 1.0})
    results = [actor.sync_weights(v, weights_dropped=dropped) for v, dropped in (("1", False), ("2", False),
                                                                                ("3", True))]
    base = [("adapters on", False), "pause", "begin", "barrier", ("sync", "skip=False", False), "barrier", "end",
            "continue", ("adapters on", True), "gather"]
    if rank:  # not the session's owner, not the sender
        base = [e for e in base if e not in ("pause", "begin", "end", "continue")]

    def send(v: str) -> list:
        return [("send", v)] if rank == 0 else []

    assert log == [*base, *send("1"), "gather", *send("2"), *base, *send("3")]
    if rank == 0:  # the base's bytes and seconds with the adapters'
        assert results[0]["weight_sync/bytes"] == 3.0 and results[1]["weight_sync/bytes"] == 2.0
        assert results[0]["weight_sync/adapter_bytes"] == 1.0
    else:
        assert results[1] == {}


def test_rank0_holds_one_session_around_the_stages_in_turn(monkeypatch):
    log: list = []
    actor = _actor(monkeypatch, log, WeightBroadcaster, pp_rank=0, pp_size=2)
    actor.sync_weights("3")
    # rank 0 (stage 0) of PP=2: its stage's turn first, then it waits out stage 1's turn; the session
    # (begin/end) is opened once for both stages, inside pause/continue
    assert log == ["pause", "begin", "barrier", ("sync", "skip=False", False), "barrier", "barrier", "barrier",
                   "end", "continue"]


def test_a_sync_after_a_release_sends_the_frozen_tensors_again(monkeypatch):
    log: list = []
    actor = _actor(monkeypatch, log, ColocatedUpdater)
    for dropped in (False, False, True, False):
        actor.sync_weights("v", weights_dropped=dropped)
    sent = [e[1] for e in log if isinstance(e, tuple)]
    # first sync: everything; then frozen skipped unless the engines dropped their weights
    assert sent == ["skip=False", "skip=True", "skip=False", "skip=True"]


def test_cluster_colocated_order_of_tags(monkeypatch):
    calls: list = []
    c = object.__new__(cluster_mod.Cluster)
    c._released, c._revived, c.plan = False, {}, SimpleNamespace(colocated=True)
    c.cfg = build_config(BASE + ["--colocate"], check_paths=False)
    c._on_engines = lambda endpoint, tags: calls.append((endpoint, tags))
    c.trainers = SimpleNamespace(sync_weights=lambda v, weights_dropped: calls.append(("sync", weights_dropped)) or {})
    c.rollout_manager = None
    monkeypatch.setattr(cluster_mod.ray, "get", lambda refs: [])
    c.sync_weights("0")  # the first sync: nothing was released, nothing is resumed (SGLang would refuse)
    c.release_engines()
    c.sync_weights("1")
    assert calls == [("sync", False),
                     ("release_memory_occupation", ["weights", "kv_cache", "cuda_graph"]),
                     ("resume_memory_occupation", ["weights"]), ("sync", True),
                     ("resume_memory_occupation", ["kv_cache", "cuda_graph"])]


@pytest.mark.parametrize("colocate", [False, True])
def test_sglang_command_picks_no_unchecked_nccl_port_and_a_colocated_memory_fraction(colocate):
    cfg = build_config(BASE + ["--rollout-backend", "sglang"] + (["--colocate"] if colocate else []),
                       check_paths=False)
    argv = engine_command(cfg, EngineSlot(engine_id=0, bundles=(0,), rank_offset=1), "10.0.0.2", 30001, None, True)
    assert "--nccl-port" not in argv  # SGLang picks a checked free port below the ephemeral range itself
    if colocate:
        assert argv[argv.index("--mem-fraction-static") + 1] == "0.7" and "--enable-memory-saver" in argv
    else:
        assert "--mem-fraction-static" not in argv


def test_an_engine_of_two_gpus_sees_the_gpus_of_the_two_trainer_ranks_it_runs_beside():
    """--colocate on GPUs with --rollout-num-gpus-per-engine 2: the engine's process gets the GPUs Ray gave
    its two trainer ranks, in rank order (its TP rank i on rank 2e+i's GPU), whatever their ids."""
    from slime_rl.config import EngineConfig, ParallelConfig
    from slime_rl.orchestration.placement import plan_placement

    plan = plan_placement(ParallelConfig(2, 1, 1, 4), EngineConfig(num_gpus=4, num_gpus_per_engine=2, colocate=True),
                          cluster_gpus=4)
    ranks = [("10.0.0.1", "3"), ("10.0.0.1", "5"), ("10.0.0.1", "0"), ("10.0.0.1", "1")]
    assert cluster_mod.colocated_visible_devices(plan, ranks) == {(0, 0): "3,5", (1, 0): "0,1"}  # (engine, node part)
    one = plan_placement(ParallelConfig(2, 1, 1, 4), EngineConfig(num_gpus=4, colocate=True), cluster_gpus=4)
    assert cluster_mod.colocated_visible_devices(one, ranks) == {}  # one GPU each: Ray's own assignment
    with pytest.raises(RuntimeError, match=r"engine 1 runs beside trainer ranks on nodes 10\.0\.0\.1, 10\.0\.0\.2; "
                                           r"its --rollout-num-gpus-per-engine 2 GPUs must be on one node"):
        cluster_mod.colocated_visible_devices(plan, ranks[:3] + [("10.0.0.2", "0")])
