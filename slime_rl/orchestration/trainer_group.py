"""The trainer group: one Ray actor per Megatron rank, each in its own placement bundle."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime_rl.config import Config
from slime_rl.orchestration.placement import dp_shard
from slime_rl.weight_sync.broadcast import GROUP_NAME, EngineTarget, WeightBroadcaster


class TrainerRankError(RuntimeError):
    """A trainer rank raised or died: names the rank and what it was doing."""

    def __init__(self, rank: int, what: str, cause: BaseException) -> None:
        self.rank, self.what = rank, what
        first = str(cause).strip().splitlines()
        super().__init__(f"trainer rank {rank} failed during {what}: {type(cause).__name__}: "
                         f"{first[-1] if first else ''}")


def gather_ranks(refs: list, what: str) -> list:
    """Every rank's result, in rank order. The first rank to fail raises `TrainerRankError` at
    once: the other ranks may be blocked in a collective waiting for it, so they are not awaited."""
    results: list = [None] * len(refs)
    pending = {ref: r for r, ref in enumerate(refs)}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            rank = pending.pop(ref)
            try:
                results[rank] = ray.get(ref)
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
                raise TrainerRankError(rank, what, e) from e
    return results


def _select(batch: dict[str, Any], indices: list[int]) -> dict[str, Any]:
    return {k: [v[i] for i in indices] for k, v in batch.items()}


@ray.remote
class TrainerActor:
    """One Megatron rank (TrainerWorker) plus its part of the weight sync."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.worker = None
        self.broadcaster: WeightBroadcaster | None = None
        self.rejoins = 0  # groups re-created after an engine restart (--use-fault-tolerance)
        # Ray gives each actor its own GPU as cuda:0; on CPU one thread per rank avoids oversubscription
        os.environ["LOCAL_RANK"] = "0"

    def master_address(self) -> tuple[str, int]:
        from slime_rl.orchestration.engines import free_port

        return ray.util.get_node_ip_address(), free_port("0.0.0.0")

    def init(self, cfg: Config, master_addr: str, master_port: int, train_iters: int, threads: int) -> None:
        import torch

        if not torch.cuda.is_available():
            torch.set_num_threads(threads)
        from slime_rl.trainer.worker import TrainerWorker

        self.cfg = cfg
        self.worker = TrainerWorker(self.rank, self.world_size, master_addr, master_port, cfg.parallel, cfg.batch,
                                    cfg.optimizer, cfg.model, cfg.algo, train_iters,
                                    **dataclasses.asdict(cfg.trainer))

    def connect_engines(self, targets: list[EngineTarget], master_addr: str, master_port: int,
                        world_size: int) -> None:
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        name = f"{GROUP_NAME}_pp{self.worker.pp_rank}"
        if self.broadcaster is not None:  # re-join after an engine restart: a fresh group, a fresh name
            self.broadcaster.destroy()
            self.rejoins += 1
            name += f"_r{self.rejoins}"
        self.broadcaster = WeightBroadcaster(targets, self.cfg.weight_sync, self.worker.is_weight_source,
                                             master_addr, master_port, world_size, backend, group_name=name)
        self.broadcaster.connect()

    def fail_at_step(self, step: int | None) -> None:
        """Test hook: make `train(step)` raise on this rank, as a crashing rank would."""
        self._fail_at_step = step

    def train(self, step: int, buffer) -> dict[str, float]:
        if getattr(self, "_fail_at_step", None) == step:
            raise RuntimeError(f"injected failure at step {step} (test hook)")
        batch = ray.get(buffer.get.remote(step, readers=self.world_size))
        n = len(batch["tokens"])
        idx = dp_shard(n, self.cfg.batch.global_batch_size, self.worker.dp_rank, self.worker.dp_size)
        return self.worker.train_step(_select(batch, idx))

    def sync_weights(self, version: str) -> dict[str, float]:
        """All ranks: pause the engines (rank 0), every stage's source sends its layers, continue."""
        import torch.distributed as dist

        assert self.broadcaster is not None, "connect_engines first"
        if self.rank == 0:
            self.broadcaster.pause_engines()
        dist.barrier()
        try:
            return self.broadcaster.sync(self.worker.iter_hf_weights(), version)
        finally:
            dist.barrier()
            if self.rank == 0:
                self.broadcaster.continue_engines()

    def save_checkpoint(self, root: str, step: int, extra: dict) -> str:
        return self.worker.save_checkpoint(root, step, extra)

    def load_latest_checkpoint(self, root: str) -> dict | None:
        return self.worker.load_latest_checkpoint(root)

    def save_hf(self, path: str) -> str:
        return self.worker.save_hf(path)

    def hf_weights(self) -> dict[str, Any]:
        """Every HF-named tensor as numpy (all ranks must call: the gathers are collective)."""
        return {name: t.detach().float().cpu().numpy() for name, t in self.worker.iter_hf_weights()}

    def shutdown(self) -> None:
        if self.broadcaster is not None:
            self.broadcaster.close()
        if self.worker is not None:
            self.worker.shutdown()


class TrainerGroup:
    """Handles to every trainer rank; methods call all ranks and return rank 0's answer."""

    def __init__(self, cfg: Config, placement_group, bundles: tuple[int, ...], use_gpu: bool) -> None:
        self.cfg = cfg
        world = cfg.parallel.world_size
        self.actors = [
            TrainerActor.options(
                num_cpus=1, num_gpus=1 if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group, bundles[r]),
            ).remote(r, world)
            for r in range(world)
        ]

    def init(self, train_iters: int, threads: int) -> None:
        addr, port = ray.get(self.actors[0].master_address.remote())
        gather_ranks([a.init.remote(self.cfg, addr, port, train_iters, threads) for a in self.actors], "init")

    def connect_engines(self, targets: list[EngineTarget], world_size: int) -> None:
        # each PP stage's source hosts its own group's rendezvous
        addrs = ray.get([a.master_address.remote() for a in self.actors])
        ray.get([a.connect_engines.remote(targets, addr, port, world_size)
                 for a, (addr, port) in zip(self.actors, addrs, strict=True)])

    def train(self, step: int, buffer) -> dict[str, float]:
        return gather_ranks([a.train.remote(step, buffer) for a in self.actors], f"train step {step}")[0]

    def sync_weights(self, version: str) -> dict[str, float]:
        """Bandwidth = bytes of every stage / the slowest stage's time (the stages send at once)."""
        results = [r for r in gather_ranks([a.sync_weights.remote(version) for a in self.actors],
                                           f"weight sync {version}") if r]
        total = sum(r["weight_sync/bytes"] for r in results)
        seconds = max(r["weight_sync/seconds"] for r in results)
        return {"weight_sync/bytes": total, "perf/weight_sync_GBps": total / seconds / 1e9}

    def save_checkpoint(self, root: str, step: int, extra: dict) -> str:
        return gather_ranks([a.save_checkpoint.remote(root, step, extra) for a in self.actors],
                            f"checkpoint save of step {step}")[0]

    def load_latest_checkpoint(self, root: str) -> dict | None:
        return ray.get([a.load_latest_checkpoint.remote(root) for a in self.actors])[0]

    def save_hf(self, path: str) -> str:
        """--save-hf: every rank takes part (gathers), rank 0 writes the folder."""
        return ray.get([a.save_hf.remote(path) for a in self.actors])[0]

    def hf_weights(self) -> dict[str, Any]:
        """The union over ranks: with PP each stage holds only its own layers."""
        merged: dict[str, Any] = {}
        for part in ray.get([a.hf_weights.remote() for a in self.actors]):
            merged |= part
        return merged

    def shutdown(self) -> None:
        ray.get([a.shutdown.remote() for a in self.actors])

    def kill(self) -> None:
        """After a rank failed: the others may wait in a collective forever, so no graceful exit."""
        for a in self.actors:
            ray.kill(a)
