"""The trainer groups: one Ray actor per Megatron rank, each in its own placement bundle; the
policy's (TrainerGroup) and, for PPO, the critic's (CriticGroup)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime_rl.config import Config
from slime_rl.orchestration.placement import dp_shard
from slime_rl.weight_sync.broadcast import GROUP_NAME, EngineTarget, WeightBroadcaster, in_stage_order
from slime_rl.weight_sync.colocated import ColocatedUpdater


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
            except ray.exceptions.RayError as e:  # a task error, a dead actor, or an error Ray cannot rebuild
                raise TrainerRankError(rank, what, e) from e
    return results


def _select(batch: dict[str, Any], indices: list[int]) -> dict[str, Any]:
    return {k: [v[i] for i in indices] for k, v in batch.items()}


def _assemble(parts: list[tuple[list[int], list]], n: int) -> list:
    """Per-DP-shard (indices, rows) -> rows in batch order. Every rank of a DP shard returns the
    same rows (TP/PP ranks agree), so any copy will do; all n samples must be covered."""
    out: list = [None] * n
    for idx, rows in parts:
        for i, row in zip(idx, rows, strict=True):
            out[i] = row
    missing = [i for i, row in enumerate(out) if row is None]
    assert not missing, f"no DP shard returned samples {missing[:5]}"
    return out


def _master_address() -> tuple[str, int]:
    """This node's address and a free port: rank 0 of a Megatron group hosts its rendezvous there."""
    from slime_rl.orchestration.engines import free_port

    ip = ray.util.get_node_ip_address()
    return ip, free_port(ip)  # the store binds this address alone (trainer.parallel.rendezvous_store)


def _set_cpu_threads(threads: int) -> None:
    """On CPU each rank gets its share of the cores (the ranks share the node's cores)."""
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(threads)


@ray.remote
class TrainerActor:
    """One Megatron rank (TrainerWorker) plus its part of the weight sync."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.worker = None
        self.broadcaster: WeightBroadcaster | ColocatedUpdater | None = None
        self.rejoins = 0  # groups re-created after an engine restart (--use-fault-tolerance)
        self._synced_once = False  # a frozen vision tower is sent by the first sync only
        # Ray gives each actor its own GPU as cuda:0; on CPU one thread per rank avoids oversubscription
        os.environ["LOCAL_RANK"] = "0"

    def master_address(self) -> tuple[str, int]:
        return _master_address()

    def init(self, cfg: Config, master_addr: str, master_port: int, train_iters: int, threads: int) -> None:
        _set_cpu_threads(threads)
        from slime_rl.trainer.worker import TrainerWorker

        self.cfg = cfg
        self.worker = TrainerWorker(self.rank, self.world_size, master_addr, master_port, cfg.parallel, cfg.batch,
                                    cfg.optimizer, cfg.model, cfg.algo, train_iters,
                                    **dataclasses.asdict(cfg.trainer))

    def connect_engines(self, targets: list[EngineTarget], master_addr: str, master_port: int,
                        world_size: int) -> None:
        """Every rank: each PP stage's source joins the engines into its own group, one stage after
        another (an engine serves one group init at a time and blocks in it: see in_stage_order)."""
        import torch.distributed as dist

        in_stage_order(self.worker.pp_rank, self.worker.pp_size, dist.barrier,
                       lambda: self._connect_engines(targets, master_addr, master_port, world_size))

    def _connect_engines(self, targets: list[EngineTarget], master_addr: str, master_port: int,
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

    def connect_colocated(self, targets: list[EngineTarget], owners: list[int]) -> None:
        """--colocate: engine e gets its weights from trainer rank owners[e] (the one on its device)."""
        self.broadcaster = ColocatedUpdater(targets, [e for e, r in enumerate(owners) if r == self.rank],
                                            self.cfg.weight_sync)

    def fail_at_step(self, step: int | None) -> None:
        """Test hook: make `train(step)` raise on this rank, as a crashing rank would."""
        self._fail_at_step = step

    def train(self, step: int, buffer, readers: int | None = None) -> dict[str, float]:
        if getattr(self, "_fail_at_step", None) == step:
            raise RuntimeError(f"injected failure at step {step} (test hook)")
        batch = ray.get(buffer.get.remote(step, readers=readers or self.world_size))
        n = len(batch["tokens"])
        idx = dp_shard(n, self.cfg.batch.global_batch_size, self.worker.dp_rank, self.worker.dp_size)
        return self.worker.train_step(_select(batch, idx))

    def train_ppo(self, step: int, buffer, readers: int, values: list, update: bool
                  ) -> tuple[dict[str, float], list[int], list]:
        """PPO: GAE on the critic's `values` (the whole batch's, in batch order), then the policy
        update unless `update` is false (--num-critic-only-steps). Returns (metrics, this DP
        shard's sample indices, their returns)."""
        batch = ray.get(buffer.get.remote(step, readers=readers))
        idx = dp_shard(len(batch["tokens"]), self.cfg.batch.global_batch_size, self.worker.dp_rank,
                       self.worker.dp_size)
        shard = _select(batch, idx)
        inputs = self.worker.step_inputs(shard, [values[i] for i in idx])
        metrics = self.worker.train_step(shard, inputs, update)
        return metrics, idx, inputs.returns

    def sync_weights(self, version: str, weights_dropped: bool = False) -> dict[str, float]:
        """All ranks: rank 0 pauses the engines and opens their weight-update session (SGLang
        0.5.23 refuses updates outside one); the stages' sources send their layers one stage after
        another (in_stage_order: stages sending at once deadlock two engines); rank 0 closes the
        session and continues the engines. `weights_dropped`: the engines released their weights
        since the last sync (colocated), so they hold nothing and everything must be sent."""
        import torch.distributed as dist

        assert self.broadcaster is not None, "connect_engines first"
        if self.rank == 0:
            self.broadcaster.pause_engines()
            self.broadcaster.begin_update()
        dist.barrier()
        failed = True
        try:
            # a frozen vision tower is sent by the first sync of this trainer process (the engines may
            # have started from another checkpoint than a resumed trainer) and after every release
            # that dropped the engines' weights; otherwise never again: it cannot change
            skip = self._synced_once and not weights_dropped
            self._synced_once = True
            if isinstance(self.broadcaster, ColocatedUpdater):  # each rank to its own engines: no cross-engine wait
                metrics = self.broadcaster.sync(self.worker.iter_hf_sources(skip_frozen=skip), version,
                                                own_session=False)
            else:
                metrics = in_stage_order(self.worker.pp_rank, self.worker.pp_size, dist.barrier,
                                         lambda: self.broadcaster.sync(self.worker.iter_hf_sources(skip_frozen=skip),
                                                                       version, own_session=False))
            failed = False
            return metrics or {}
        finally:
            dist.barrier()
            if self.rank == 0:
                self.broadcaster.end_update(quiet=failed)
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

    def __init__(self, cfg: Config, placement_group, bundles: tuple[int, ...], use_gpu: bool,
                 num_gpus: float | None = None) -> None:
        self.cfg = cfg
        world = cfg.parallel.world_size
        self.actors = [
            TrainerActor.options(
                num_cpus=1, num_gpus=(1 if use_gpu else 0) if num_gpus is None else num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group, bundles[r]),
            ).remote(r, world)
            for r in range(world)
        ]

    def init(self, train_iters: int, threads: int) -> None:
        addr, port = ray.get(self.actors[0].master_address.remote())
        gather_ranks([a.init.remote(self.cfg, addr, port, train_iters, threads) for a in self.actors], "init")

    def connect_engines(self, targets: list[EngineTarget], world_size: int) -> None:
        # each PP stage's source hosts its own group's rendezvous; the stages join in turns (actor side)
        addrs = ray.get([a.master_address.remote() for a in self.actors])
        ray.get([a.connect_engines.remote(targets, addr, port, world_size)
                 for a, (addr, port) in zip(self.actors, addrs, strict=True)])

    def connect_colocated(self, targets: list[EngineTarget], owners: list[int]) -> None:
        ray.get([a.connect_colocated.remote(targets, owners) for a in self.actors])

    def train(self, step: int, buffer, readers: int | None = None) -> dict[str, float]:
        return gather_ranks([a.train.remote(step, buffer, readers) for a in self.actors], f"train step {step}")[0]

    def train_ppo(self, step: int, buffer, readers: int, values: list, update: bool
                  ) -> tuple[dict[str, float], list]:
        """(metrics of rank 0, the returns of every sample in batch order)."""
        results = gather_ranks([a.train_ppo.remote(step, buffer, readers, values, update) for a in self.actors],
                               f"train step {step}")
        return results[0][0], _assemble([(idx, rows) for _, idx, rows in results], len(values))

    def sync_weights(self, version: str, weights_dropped: bool = False) -> dict[str, float]:
        """Bandwidth = bytes of every stage / the sum of the stages' times (they send one after another)."""
        results = [r for r in gather_ranks([a.sync_weights.remote(version, weights_dropped) for a in self.actors],
                                           f"weight sync {version}") if r]
        total = sum(r["weight_sync/bytes"] for r in results)
        seconds = sum(r["weight_sync/seconds"] for r in results)
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

@ray.remote
class CriticActor:
    """One rank of PPO's critic (critic.CriticWorker); keeps its DP shard of the step's batch and
    the values it computed between `compute_values` and `train`."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.worker = None
        self._step: tuple[list[int], dict[str, Any], list] | None = None
        os.environ["LOCAL_RANK"] = "0"

    def master_address(self) -> tuple[str, int]:
        return _master_address()

    def init(self, cfg: Config, master_addr: str, master_port: int, train_iters: int, threads: int) -> None:
        _set_cpu_threads(threads)
        from slime_rl.trainer.critic import CriticWorker

        self.cfg, critic = cfg, cfg.critic
        self.worker = CriticWorker(self.rank, self.world_size, master_addr, master_port,
                                   critic.parallel(cfg.parallel), cfg.batch, critic.optimizer(cfg.optimizer),
                                   cfg.model, cfg.algo, train_iters, **dataclasses.asdict(cfg.trainer))
        if critic.load and self.worker.load_latest_checkpoint(critic.load) is None:
            raise ValueError(f"--critic-load {critic.load}: no complete checkpoint there")

    def compute_values(self, step: int, buffer, readers: int) -> tuple[list[int], list]:
        batch = ray.get(buffer.get.remote(step, readers=readers))
        idx = dp_shard(len(batch["tokens"]), self.cfg.batch.global_batch_size, self.worker.dp_rank,
                       self.worker.dp_size)
        shard = _select(batch, idx)
        values = self.worker.compute_values(shard)
        self._step = (idx, shard, values)
        return idx, values

    def train(self, returns: list) -> dict[str, float]:
        assert self._step is not None, "compute_values first"
        idx, shard, values = self._step
        self._step = None
        return self.worker.train_step(shard, values, [returns[i] for i in idx])

    def save_checkpoint(self, root: str, step: int, extra: dict) -> str:
        return self.worker.save_checkpoint(root, step, extra)

    def load_latest_checkpoint(self, root: str) -> dict | None:
        return self.worker.load_latest_checkpoint(root)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


class CriticGroup:
    """PPO's critic ranks (their own process group, placement bundles, optimizer and LR)."""

    def __init__(self, cfg: Config, placement_group, bundles: tuple[int, ...], use_gpu: bool) -> None:
        assert cfg.critic is not None and len(bundles) == cfg.critic.world_size
        self.cfg = cfg
        self.actors = [
            CriticActor.options(
                num_cpus=1, num_gpus=1 if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group, bundles[r]),
            ).remote(r, len(bundles))
            for r in range(len(bundles))
        ]

    def init_async(self, train_iters: int, threads: int) -> list:
        """Start building the critic ranks; returns the refs to wait on."""
        addr, port = ray.get(self.actors[0].master_address.remote())
        return [a.init.remote(self.cfg, addr, port, train_iters, threads) for a in self.actors]

    def compute_values(self, step: int, buffer, readers: int) -> list:
        """Values of every sample's response tokens, in batch order (the step's batch is read from
        the buffer; `readers` counts policy and critic ranks)."""
        results = ray.get([a.compute_values.remote(step, buffer, readers) for a in self.actors])
        return _assemble(results, 1 + max(i for idx, _ in results for i in idx))  # the DP shards cover 0..n-1

    def train(self, returns: list) -> dict[str, float]:
        return ray.get([a.train.remote(returns) for a in self.actors])[0]

    def save_checkpoint(self, root: str, step: int, extra: dict) -> str:
        return ray.get([a.save_checkpoint.remote(root, step, extra) for a in self.actors])[0]

    def load_latest_checkpoint(self, root: str) -> dict | None:
        return ray.get([a.load_latest_checkpoint.remote(root) for a in self.actors])[0]

    def shutdown(self) -> None:
        ray.get([a.shutdown.remote() for a in self.actors])
